"""Paired serving comparison: every configuration's server up at once, measured in turns.

    python benchmark/paired_serving.py --preset smollm2|llama8b_dummy \
        [--configs no_spec adaptive] [--concurrency 1 4 16 64 256] [--rounds 3] \
        [--output-len 64] [--server-args "--max-total-tokens 200000"] [--deadline-s 540] \
        [--result-file FILE]

Why: sweep_serving.py runs one configuration after another, minutes apart, and on the H200
machine the host's speed drifts over minutes: in the 2026-11-30 sweep
(`sweep_smollm2_h200_s8.json`), three configurations that run the same plain decode steps at
concurrency 64 (no_spec, adaptive and the tier table, which turns drafting off there) had
median ITLs of 3.95, 3.43 and 3.11 ms, and points last about a second. A ratio such as
"adaptive / no speculation >= 0.98" cannot be read from such runs. Here the servers of all
configurations run side by side (started one after another, so that each start-up, and the
adaptive server's step-time warm-up, has the GPU alone; each gets --server-args, e.g. a smaller
--max-total-tokens so that both fit), and at each concurrency c the configurations take turns
for --rounds rounds, in ABBA order (round r runs the configurations in order when r is even,
reversed when odd), so that a drift over the round cancels. By default (--order round) round 0
runs at every concurrency before round 1 starts, so the rounds of one concurrency lie minutes
apart (schedule()). Only one server has requests at a
time (an idle scheduler blocks on its socket). Points are as in sweep_serving.py (same
prompts, flush before each point, all requests at once, at most c in flight, greedy,
ignore_eos, fixed output length).

Reported per concurrency and configuration (`summary`): the median, min and max over rounds of
output tok/s, median TTFT and median ITL; the median cores kept busy by the client, the
server's HTTP process and its scheduler process (each point's `cpu_util`, from /proc: a
single-threaded role near 1.0 caps the point); the median microseconds per forward step of
each scheduler host phase (each point's `host_us_per_step`, from the server's host_s_<phase>
counters; the table shows their sum without `resolve`, and `resolve`, the wait for the
device); and the paired ratio to the first configuration
(output tok/s of the same round), its median, min and max over rounds. Raw points under
`points` (summary and table: paired_report.py). A markdown table is written next to the
JSON, followed by each configuration's verdict against the 0.97 goal with the run's own
noise (ratio_verdict.py: rounds, and server instances through the A/A twin) and by what was
not measured.
With --cpu-sets (one CPU list per configuration) each server's processes run on their own
cores, and --client-cpus pins this process: servers side by side then do not share cores with
each other or with the client (in the eleventh session's py-spy of both SmolLM2 servers at
c = 16, the adaptive scheduler needed about 40% more busy samples than the plain one for the
same steps, in every phase alike, its pure-Python output flush included).
Points are longer than sweep_serving.py's by default (at least 24 prompts and 8 per unit of
concurrency, against 16 and 2): in the twelfth session's A/A run (a second no_spec server as a
third configuration, `paired_smollm2_bisect_h200_s12.json`), points of 0.5-1.5 s let two
identical servers differ by up to 1.8x in one round and 0.82-0.94 in the median over four;
with the longer points (`paired_smollm2_aa_h200_s12.json`) the A/A medians were 0.86-1.20, so
a ratio read from these runs carries about that much noise. `--add-config no_spec_b=` adds
such an A/A control.
With --restart-every N every server is stopped and started again (same flags and CPUs) before
each round r > 0 with r % N == 0, and each point records the instance that ran it: identical
processes of one configuration differ by more than the ratios sought (thirty-first session:
0.65-0.82 ms per batch-1 step, pinned to one core), so ratios over rounds of one instance
carry that process's bias.
Time-boxed by --deadline-s (the points left are recorded as skipped). A server that fails to
start stops the run (its error and log tail under `configs`); an interrupt (SIGTERM, Ctrl-C) or
a failure outside a point is recorded as `error`; every server started is killed either way.
The exit status is 1 when a server failed to start or a point failed or timed out
(bench_common.failed_parts, listed on stderr), else 0.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from typing import Any

from bench_common import error_record, exit_status, run_meta, write_json
from bench_server import Server, log_tail, parse_cpu_list
from host_probe import HostProbe
from paired_report import markdown, summarize
from sweep_presets import config_flags
from sweep_serving import (
    MIN_POINT_S,
    Sweep,
    build_parser,
    load_rows,
    resolve_args,
)


def round_order(configs: list[str], r: int) -> list[str]:
    """The configurations of round r: in order when r is even, reversed when odd (ABBA)."""
    return list(configs) if r % 2 == 0 else list(reversed(configs))


def schedule(
    concurrency: list[int], rounds: int, configs: list[str], order: str
) -> list[tuple[int, int, str]]:
    """The run's points as (c, round, configuration), in the order they run. "concurrency":
    every round of one c back to back, then the next c (the order through the twenty-first
    session). "round": round 0 at every c, then round 1 at every c, ... so that the rounds of
    one c lie minutes apart instead of seconds: a server's state that lasts longer than a round
    (the A/A twin was 1.15x its base in all three back-to-back rounds at c = 16 in the
    twenty-first session) then varies between rounds and shows in their spread instead of
    biasing their mean. Each round keeps the ABBA order of round_order. Raises ValueError for
    another order."""
    if order == "concurrency":
        return [
            (c, r, n) for c in concurrency for r in range(rounds) for n in round_order(configs, r)
        ]
    if order == "round":
        return [
            (c, r, n) for r in range(rounds) for c in concurrency for n in round_order(configs, r)
        ]
    raise ValueError(f"order must be 'round' or 'concurrency', got {order!r}")


def instance_of(r: int, restart_every: int | None) -> int:
    """The server instance that runs round r: every configuration's servers are started
    again before each round r > 0 with r % restart_every == 0 (--restart-every), so rounds
    [k * n, (k + 1) * n) run on instance k; 0 throughout without restarts."""
    return r // restart_every if restart_every else 0


class PairedRun:
    def __init__(self, args, preset, result: dict) -> None:
        self.args, self.preset, self.result = args, preset, result
        self.sweep = Sweep(args, preset, result)  # prompts count, dummy draft, deadline
        self.servers: dict[str, Server] = {}
        self.probe: HostProbe | None = None

    def save(self) -> None:
        self.result["summary"] = summarize(self.result["points"], self.args.configs)
        write_json(self.args.result_file, self.result)
        with open(self.args.result_file.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(markdown(self.result))

    def start_servers(self) -> bool:
        """Start each configuration's server, one after another; False when one failed."""
        a = self.args
        os.makedirs(a.log_dir, exist_ok=True)
        for name in a.configs:
            flags = config_flags(self.preset, name, self.sweep.extra)
            flags += shlex.split(a.server_args)
            cfg: dict[str, Any] = {"name": name, "flags": flags}
            self.result["configs"].append(cfg)
            if not self.start_one(name, flags, f"paired_{a.preset}_{name}.log", cfg):
                return False
        n_max = max(self.sweep.num_prompts(c) for c in a.concurrency)
        # on the Sweep, whose run_point measures each point
        self.sweep.rows = load_rows(self.servers[a.configs[0]], a, n_max)
        self.result["num_rows"] = len(self.sweep.rows)
        return True

    def restart_servers(self, instance: int) -> bool:
        """--restart-every: stop each configuration's server and start it again with the same
        flags and CPUs, one after another, each start recorded under its configuration's
        `restarts`; False when one failed (the prompt rows stay the first instance's)."""
        for cfg in self.result["configs"]:
            name = cfg["name"]
            self.servers.pop(name).stop()
            record: dict[str, Any] = {"instance": instance}
            cfg.setdefault("restarts", []).append(record)
            log = f"paired_{self.args.preset}_{name}_i{instance}.log"
            if not self.start_one(name, cfg["flags"], log, record):
                return False
        return True

    def start_one(self, name: str, flags: list[str], log_name: str, record: dict) -> bool:
        """Start configuration `name`'s server (on its CPU set, if any; the preset's dummy
        draft first, once per run) and wait until it is ready. Into `record`: its CPUs, its
        command and its start-up seconds, or its error and log tail (False)."""
        a = self.args
        log_path = os.path.join(a.log_dir, log_name)
        t0 = time.monotonic()
        try:
            self.sweep.make_draft(flags)
            cpus = a.cpu_sets[a.configs.index(name)] if a.cpu_sets else a.inherited_cpus
            server = self.servers[name] = Server(flags, log_path, cpus)
            record["cpus"] = cpus
            record["command"] = server.shell_command()
            server.wait_ready(max(1.0, min(a.startup_timeout_s, self.left())))
            record["startup_s"] = time.monotonic() - t0
            return True
        except Exception as e:  # noqa: BLE001 - recorded; no comparison without it
            record.update(status="error", error="server start: " + error_record(e))
            record["log_tail"] = log_tail(log_path)
            return False

    def left(self) -> float:
        return self.sweep.deadline - time.monotonic()

    def run(self) -> None:
        try:
            if self.args.host_probe_cpu is not None:  # host speed through the run (host_probe)
                self.probe = HostProbe(self.args.host_probe_cpu).start()
            if not self.start_servers():
                return
            a = self.args
            instance = 0
            for c, r, name in schedule(a.concurrency, a.rounds, a.configs, a.order):
                if instance_of(r, a.restart_every) != instance:  # --restart-every
                    instance = instance_of(r, a.restart_every)
                    # past the deadline the points are recorded as skipped (point); a server
                    # that fails to start again ends the run (its error under `restarts`)
                    if self.left() >= MIN_POINT_S and not self.restart_servers(instance):
                        return
                n = min(self.sweep.num_prompts(c), len(self.sweep.rows))
                self.point(name, c, r, n)
                self.result["points"][-1]["instance"] = instance
                self.save()
        finally:
            for server in self.servers.values():
                server.stop()
            if self.probe is not None:
                self.probe.stop()

    def point(self, name: str, c: int, r: int, n: int) -> None:
        point: dict[str, Any] = {"concurrency": c, "round": r, "config": name, "num_prompts": n}
        self.result["points"].append(point)
        server = self.servers[name]
        a = self.args
        if a.cpu_sets and a.rotate_cpu_sets:  # round r: configuration i on set (i + r) mod n
            cpus = a.cpu_sets[(a.configs.index(name) + r) % len(a.cpu_sets)]
            point["cpus"] = cpus
            point["threads_pinned"] = server.set_cpus(cpus)
        left = self.left()
        if left < MIN_POINT_S or server.proc.poll() is not None:
            point.update(status="skipped", reason="deadline" if left < MIN_POINT_S else "dead")
            return
        t0 = time.time()
        self.sweep.run_point(server, f"{name} round {r}", point, left)  # as a sweep's point
        if self.probe is not None:  # the host's speed while the point ran
            w = self.probe.window(t0, time.time())
            point["host_probe_us"] = w["median_us"] if w else None
            point["host_probe_units"] = w["units"] if w else 0
            code = self.probe.exit_code()
            if code is not None:  # no more samples: say so instead of thinning the tables
                self.result["host_probe_error"] = f"the probe's worker exited with code {code}"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--rounds", type=int, default=3, help="turns per configuration and c")
    p.add_argument(
        "--cpu-sets",
        nargs="+",
        default=None,
        help="one CPU list per configuration (e.g. 0-5 6-11): each server's processes run "
        "there only, so side-by-side servers do not share cores",
    )
    p.add_argument("--client-cpus", default=None, help="CPU list for this benchmark process")
    p.add_argument(
        "--order",
        choices=("round", "concurrency"),
        default="round",
        help="round: round 0 at every concurrency, then round 1, ... (rounds of one c minutes "
        "apart); concurrency: all rounds of one c back to back (before the twenty-second "
        "session); see schedule()",
    )
    p.add_argument(
        "--rotate-cpu-sets",
        action="store_true",
        help="with --cpu-sets: in round r, configuration i runs on set (i + r) mod n (every "
        "thread of its server re-pinned before its point), so that no configuration keeps "
        "the cores that another one had (in the thirteenth session an A/A server differed by "
        "up to 1.3x from its twin in one round)",
    )
    p.add_argument(
        "--host-probe-cpu",
        type=int,
        default=None,
        help="run host_probe.py's worker on this CPU (one no server or client uses): each "
        "point records the host's speed while it ran (host_probe_us), and the tables add "
        "ratios adjusted for it",
    )
    p.add_argument(
        "--restart-every",
        type=int,
        default=None,
        help="with --order round: stop every server and start it again (same flags and CPUs) "
        "before each round r > 0 with r %% N == 0, so that the ratios average over server "
        "processes too (in the thirty-first session the same configuration ran 0.65-0.82 ms "
        "per batch-1 step in processes pinned to one core); each point records its instance",
    )
    p.set_defaults(min_prompts=24, prompts_per_concurrency=8)  # longer points (docstring)
    args = p.parse_args(argv)
    if args.config_budget_s is not None:
        raise SystemExit("--config-budget-s is sweep_serving.py's; a paired run has --deadline-s")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    default_file = args.result_file is None
    preset = resolve_args(args)
    if len(args.configs) < 2:
        raise SystemExit(f"a paired comparison needs >= 2 configurations, got {args.configs}")
    if len(set(args.configs)) < len(args.configs):  # one server per name: a repeat would leak
        raise SystemExit(f"--configs names a configuration twice: {args.configs}")
    if args.rotate_cpu_sets and not args.cpu_sets:
        raise SystemExit("--rotate-cpu-sets needs --cpu-sets")
    if args.restart_every is not None:
        if args.restart_every < 1:
            raise SystemExit(f"--restart-every must be >= 1, got {args.restart_every}")
        if args.order != "round":  # rounds of one c back to back: a restart between each
            raise SystemExit("--restart-every needs --order round")
    if args.cpu_sets is not None and len(args.cpu_sets) != len(args.configs):
        raise SystemExit(
            f"--cpu-sets gives {len(args.cpu_sets)} CPU lists for configurations {args.configs}"
        )
    taken: set[int] = set()  # CPUs of the servers and the client (the probe needs its own)
    for text in [*(args.cpu_sets or []), *([args.client_cpus] if args.client_cpus else [])]:
        try:
            taken |= parse_cpu_list(text)
        except ValueError as e:
            raise SystemExit(f"--cpu-sets / --client-cpus: {e}") from None
    if args.host_probe_cpu is not None:
        if args.host_probe_cpu not in os.sched_getaffinity(0):
            raise SystemExit(f"--host-probe-cpu {args.host_probe_cpu} is not a CPU of this machine")
        if args.host_probe_cpu in taken:  # the probe would load that core and track it
            raise SystemExit(
                f"--host-probe-cpu {args.host_probe_cpu} is in --cpu-sets / --client-cpus; "
                "give it a CPU of its own"
            )
    # Without --cpu-sets a server keeps the CPUs this process had before --client-cpus pinned
    # it (a child inherits its parent's affinity: else every server would share the client's)
    args.inherited_cpus = None
    if args.client_cpus:
        args.inherited_cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, parse_cpu_list(args.client_cpus))
    if default_file:
        args.result_file = args.result_file.replace("sweep_", "paired_")
    settings = {
        k: getattr(args, k)
        for k in (
            "preset", "configs", "concurrency", "rounds", "output_len", "min_prompts",
            "prompts_per_concurrency", "max_prompts", "dataset", "dataset_path",
            "chat_template", "server_args", "deadline_s", "cpu_sets", "client_cpus",
            "rotate_cpu_sets", "order", "host_probe_cpu", "restart_every",
        )
    }  # fmt: skip
    settings["model_flags"] = preset.model_flags
    result: dict[str, Any] = {
        "meta": run_meta(["benchmark/paired_serving.py"] + argv),
        "settings": settings,
        "configs": [],
        "points": [],
    }
    run = PairedRun(args, preset, result)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run finally:
    try:
        run.run()
    except BaseException as e:  # SIGTERM / Ctrl-C, or a failure outside a point: recorded
        result["error"] = ("" if isinstance(e, Exception) else "interrupted, ") + error_record(e)
        raise
    finally:
        result["total_s"] = time.monotonic() - run.sweep.t_start
        run.save()
    print(f"wrote {args.result_file}")
    return result


if __name__ == "__main__":
    sys.exit(exit_status(main()))
