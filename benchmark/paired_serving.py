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
`points`. A markdown table is written next to the JSON, followed by each configuration's
verdict against the 0.97 goal with the run's own noise (ratio_verdict.py: rounds, and server
instances through the A/A twin) and by what was not measured.
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
Time-boxed by --deadline-s (the points left are recorded as skipped). A server that fails to
start stops the run (its error and log tail under `configs`); an interrupt (SIGTERM, Ctrl-C) or
a failure outside a point is recorded as `error`; every server started is killed either way.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import statistics
import sys
import time
from typing import Any

from bench_common import error_record, run_meta, write_json
from bench_server import Server, log_tail, parse_cpu_list
from host_probe import HostProbe, host_adjusted_ratio, log_correlation
from ratio_verdict import verdict_markdown
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


# Processes whose CPU use a point records (sweep_serving._cpu_util): the benchmark client and
# the server's HTTP process and scheduler process.
CPU_ROLES = ("client", "http", "scheduler")


def summarize(points: list[dict], configs: list[str]) -> list[dict]:
    """Per (concurrency, configuration) over the rounds whose point is ok: median / min / max
    of output tok/s, medians of the points' median TTFT and ITL, and the paired ratio of
    output tok/s to configs[0] in the same round (rounds where both are ok). With an A/A twin
    of configs[0] among the configurations (named configs[0] + "_b", e.g. `--add-config
    no_spec_b=`), also each other configuration's ratio to the geometric mean of the two in
    the same round (`ratio_to_twins_*`): a baseline of two servers, so one server's luck in a
    round moves it half as much (the fourteenth and fifteenth sessions' twins differed by up
    to 16% in a median)."""
    base = configs[0]
    twin = f"{base}_b" if f"{base}_b" in configs else None
    by_key: dict[tuple[int, str], dict[int, dict]] = {}
    for p in points:
        if p.get("status") == "ok":
            by_key.setdefault((p["concurrency"], p["config"]), {})[p["round"]] = p
    out = []
    for c in sorted({p["concurrency"] for p in points}):
        for name in configs:
            runs = by_key.get((c, name), {})
            row: dict[str, Any] = {"concurrency": c, "config": name, "rounds": len(runs)}
            if runs:
                tput = [p["output_throughput"] for p in runs.values()]
                row["output_tok_s_median"] = statistics.median(tput)
                row["output_tok_s_min"], row["output_tok_s_max"] = min(tput), max(tput)
                for key in ("median_ttft_ms", "median_itl_ms"):
                    row[key] = statistics.median(p[key] for p in runs.values())
                host = [p["host_us_per_step"] for p in runs.values() if p.get("host_us_per_step")]
                for phase in host[0] if host else ():  # scheduler thread, median over rounds
                    row[f"host_us_{phase}_median"] = statistics.median(h[phase] for h in host)
                gcs = [p["gc_per_step"]["us"] for p in runs.values() if p.get("gc_per_step")]
                if gcs:  # the process's garbage collector, inside the host phases
                    row["gc_us_per_step_median"] = statistics.median(gcs)
                utils = [p["cpu_util"] for p in runs.values() if p.get("cpu_util")]
                for role in CPU_ROLES:  # cores busy, median over rounds (sweep_serving)
                    if utils:
                        row[f"cpu_{role}_median"] = statistics.median(u[role] for u in utils)
            ratios = [
                p["output_throughput"] / b["output_throughput"]
                for r, p in runs.items()
                if (b := by_key.get((c, base), {}).get(r)) and b["output_throughput"]
            ]
            if ratios and name != base:
                row["ratio_to_base_median"] = statistics.median(ratios)
                row["ratio_to_base_min"], row["ratio_to_base_max"] = min(ratios), max(ratios)
            twins = [
                p["output_throughput"] / math.sqrt(b["output_throughput"] * t["output_throughput"])
                for r, p in (runs.items() if twin is not None and name not in (base, twin) else ())
                if (b := by_key.get((c, base), {}).get(r))
                and (t := by_key.get((c, twin), {}).get(r))
                and b["output_throughput"] * t["output_throughput"] > 0
            ]
            probed = [p for p in runs.values() if p.get("host_probe_us")]
            if probed:  # host speed while the points ran (paired_serving --host-probe-cpu)
                row["host_probe_us_median"] = statistics.median(p["host_probe_us"] for p in probed)
                corr = log_correlation(
                    [p["output_throughput"] for p in probed], [p["host_probe_us"] for p in probed]
                )
                if corr is not None:  # strongly negative: the probe explains the drift
                    row["host_probe_log_corr"] = corr
            adjusted = [
                x
                for r, p in runs.items()
                if (b := by_key.get((c, base), {}).get(r))
                and (x := host_adjusted_ratio(p, b)) is not None
            ]
            if adjusted and name != base:
                row["ratio_host_adjusted_median"] = statistics.median(adjusted)
                row["ratio_host_adjusted_min"] = min(adjusted)
                row["ratio_host_adjusted_max"] = max(adjusted)
            if twins:
                row["ratio_to_twins_median"] = statistics.median(twins)
                row["ratio_to_twins_min"], row["ratio_to_twins_max"] = min(twins), max(twins)
            out.append(row)
    return out


def _tok_s(x: float) -> str:
    """Output tok/s for the table: whole numbers, three significant digits below 100 (CPU
    runs measure about 1 tok/s, which "%.0f" shows as 0 or 1)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _ratio_cell(row: dict, key: str) -> str:
    """A summary row's `<key>_median` (min-max) for the table, or - when it has none."""
    if f"{key}_median" not in row:
        return "-"
    return f"{row[key + '_median']:.3f} ({row[key + '_min']:.3f}-{row[key + '_max']:.3f})"


def failures(result: dict) -> list[str]:
    """Markdown list items for what was not measured: the run's error (an interrupt, or a
    failure after the servers started), each configuration's start-up error, each failed
    point, and the skipped points counted by reason. [] when every point ran."""
    items = []
    if result.get("error"):
        items.append(f"- run stopped: {result['error']}")
    if result.get("host_probe_error"):
        items.append(f"- host probe: {result['host_probe_error']}")
    for cfg in result.get("configs", []):
        if cfg.get("status") == "error":
            items.append(f"- {cfg['name']}: {cfg['error'].splitlines()[0][:300]}")
    skipped: dict[str, int] = {}
    for p in result.get("points", []):
        if p.get("status") == "skipped":
            skipped[p["reason"]] = skipped.get(p["reason"], 0) + 1
        elif p.get("status") != "ok":
            err = str(p.get("error", "")).splitlines()[0][:300] if p.get("error") else ""
            items.append(
                f"- c={p['concurrency']} round {p['round']} {p['config']}: {p.get('status')}"
                + (f": {err}" if err else "")
            )
    items += [f"- {n} point(s) skipped: {why}" for why, n in sorted(skipped.items())]
    return items


def markdown(result: dict) -> str:
    """The summary as a markdown table, with the command that produced it and a list of what
    was not measured (see failures)."""
    configs = result["settings"]["configs"]
    lines = [
        f"Paired serving comparison, preset {result['settings']['preset']}, "
        f"ratio to {configs[0]} (same round), {result['settings']['rounds']} rounds (ABBA)",
        "",
        "    " + result["meta"]["command"],
        "",
        "| c | config | rounds | output tok/s (median, min-max) | ratio (median, min-max) "
        "| TTFT ms | ITL ms | cores busy: client / http / scheduler "
        "| scheduler host us per step: busy / resolve (gc: of both, the garbage collector) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    twins = any("ratio_to_twins_median" in r for r in result["summary"])
    if twins:  # one more column: the ratio to both A/A twins (summarize)
        lines[4] += f" ratio to {configs[0]} and its twin (geometric mean) |"
        lines[5] += "---|"
    probed = any("host_probe_us_median" in r for r in result["summary"])
    if probed:  # host_probe.py: the host's speed in each point, and ratios per unit of it
        lines[4] += (
            " host probe us (median) | corr(log tok/s, log probe) "
            "| ratio per unit of host speed (median, min-max) |"
        )
        lines[5] += "---|---|---|"
    for r in result["summary"]:
        if not r["rounds"]:
            empty = " - |" * (6 + twins + 3 * probed)
            lines.append(f"| {r['concurrency']} | {r['config']} | 0 |{empty}")
            continue
        host = "-"
        if "host_us_resolve_median" in r:
            busy = sum(  # the prefill parts (host_us_<phase>_extend) are inside their phases
                v
                for k, v in r.items()
                if k.startswith("host_us_") and "resolve" not in k and "_extend" not in k
            )
            host = f"{busy:.0f} / {r['host_us_resolve_median']:.0f}"
            if "gc_us_per_step_median" in r:  # of which the garbage collector
                host += f" (gc {r['gc_us_per_step_median']:.0f})"
        cpu = "-"
        if f"cpu_{CPU_ROLES[0]}_median" in r:
            cpu = " / ".join(f"{r[f'cpu_{role}_median']:.2f}" for role in CPU_ROLES)
        tput = (
            f"{_tok_s(r['output_tok_s_median'])} ({_tok_s(r['output_tok_s_min'])}-"
            f"{_tok_s(r['output_tok_s_max'])})"
        )
        ratio = _ratio_cell(r, "ratio_to_base")
        line = (
            f"| {r['concurrency']} | {r['config']} | {r['rounds']} | {tput} | {ratio} "
            f"| {r['median_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} | {cpu} | {host} |"
        )
        if twins:
            line += f" {_ratio_cell(r, 'ratio_to_twins')} |"
        if probed:
            us = r.get("host_probe_us_median")
            corr = r.get("host_probe_log_corr")
            line += (
                f" {'-' if us is None else f'{us:.0f}'} | {'-' if corr is None else f'{corr:.2f}'}"
                f" | {_ratio_cell(r, 'ratio_host_adjusted')} |"
            )
        lines.append(line)
    judged = verdict_markdown(result)  # the 0.97 goal, with the noise the run itself shows
    if judged:
        lines += ["", *judged]
    missing = failures(result)
    if missing:
        lines += ["", "Not measured:", "", *missing]
    return "\n".join(lines) + "\n"


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
            log_path = os.path.join(a.log_dir, f"paired_{a.preset}_{name}.log")
            t0 = time.monotonic()
            try:
                self.sweep.make_draft(flags)
                cpus = a.cpu_sets[a.configs.index(name)] if a.cpu_sets else a.inherited_cpus
                server = self.servers[name] = Server(flags, log_path, cpus)
                cfg["cpus"] = cpus
                cfg["command"] = " ".join(shlex.quote(c) for c in server.cmd)
                server.wait_ready(max(1.0, min(a.startup_timeout_s, self.left())))
                cfg["startup_s"] = time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - recorded; no comparison without it
                cfg.update(status="error", error="server start: " + error_record(e))
                cfg["log_tail"] = log_tail(log_path)
                return False
        n_max = max(self.sweep.num_prompts(c) for c in a.concurrency)
        # on the Sweep, whose run_point measures each point
        self.sweep.rows = load_rows(self.servers[a.configs[0]], a, n_max)
        self.result["num_rows"] = len(self.sweep.rows)
        return True

    def left(self) -> float:
        return self.sweep.deadline - time.monotonic()

    def run(self) -> None:
        try:
            if self.args.host_probe_cpu is not None:  # host speed through the run (host_probe)
                self.probe = HostProbe(self.args.host_probe_cpu).start()
            if not self.start_servers():
                return
            a = self.args
            for c, r, name in schedule(a.concurrency, a.rounds, a.configs, a.order):
                n = min(self.sweep.num_prompts(c), len(self.sweep.rows))
                self.point(name, c, r, n)
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
    if args.host_probe_cpu is not None:
        if args.host_probe_cpu not in os.sched_getaffinity(0):
            raise SystemExit(f"--host-probe-cpu {args.host_probe_cpu} is not a CPU of this machine")
        for text in [*(args.cpu_sets or []), *([args.client_cpus] if args.client_cpus else [])]:
            try:
                taken = args.host_probe_cpu in parse_cpu_list(text)
            except ValueError:
                continue  # reported below
            if taken:  # the probe would load that core and track it by construction
                raise SystemExit(
                    f"--host-probe-cpu {args.host_probe_cpu} is in --cpu-sets / --client-cpus "
                    f"({text}); give it a CPU of its own"
                )
    if args.rotate_cpu_sets and not args.cpu_sets:
        raise SystemExit("--rotate-cpu-sets needs --cpu-sets")
    if args.cpu_sets is not None and len(args.cpu_sets) != len(args.configs):
        raise SystemExit(
            f"--cpu-sets gives {len(args.cpu_sets)} CPU lists for configurations {args.configs}"
        )
    for text in [*(args.cpu_sets or []), *([args.client_cpus] if args.client_cpus else [])]:
        try:
            parse_cpu_list(text)
        except ValueError as e:
            raise SystemExit(f"--cpu-sets / --client-cpus: {e}") from None
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
            "rotate_cpu_sets", "order", "host_probe_cpu",
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
    main()
