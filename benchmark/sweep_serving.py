"""Serving sweep: one launch_server per configuration, bench_serving at each concurrency.

    python benchmark/sweep_serving.py --preset smollm2|llama8b_dummy|issue6 \
        [--configs no_spec adaptive ...] [--concurrency 1 2 4 ...] [--output-len 128] \
        [--min-prompts 16] [--max-prompts 512] [--config-budget-s 150] [--deadline-s 540] \
        [--server-args "--attention-backend triton"] [--result-file FILE] [--log-dir DIR]

Configurations and presets: benchmark/sweep_presets.py (no_spec, fixed_k1/3/5: static K,
tiers: batch-size tier table, adaptive: per-request goodput policy at K = 5). For each
configuration: start `python -m sglang.launch_server` (its flags, the preset's model flags,
then --server-args, on a free port; log in --log-dir), wait for /health and one successful
/generate, then for each concurrency c: flush the prefix cache and run bench_serving's
benchmark() in-process on the first n = min(max(min_prompts, 2c), max_prompts, available)
prompts (same prompts for every configuration), max concurrency c, all requests at once,
fixed output length, ignore_eos, greedy. Per point: output tok/s, TTFT and ITL (mean, median,
p99), accept length, and the scheduler's counters from /get_server_info. Then the server is
killed (its whole process tree) and the next configuration starts.

Time-boxed: a configuration stops starting points when --config-budget-s (from when it serves) is
spent, the sweep when --deadline-s (from the start) is; those points and configurations are
recorded as "skipped". A running point is cancelled at either limit ("timeout"). A server that
fails to start, or a point that fails, records its error (with the server log's tail) and the
sweep goes on. The JSON is rewritten after every point. The exit status is 1 when a configuration
failed to start or a point failed or timed out (bench_common.failed_parts, listed on stderr),
else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from bench_common import RESULTS_DIR, error_record, exit_status, run_meta, write_json
from bench_server import Server, log_tail
from proc_cpu import cpu_seconds_by_role
from sweep_presets import CONFIGS, MTBENCH, PRESETS, Preset, config_flags

KEEP_METRICS = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_throughput",
    "concurrency",
    "accept_length",
)
KEEP_MS = ("ttft", "itl", "tpot", "e2e_latency")
MIN_POINT_S = 5.0  # do not start a point with less time than this left


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--configs", nargs="+", default=None, help="default: the preset's")
    p.add_argument(
        "--add-config",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="extra configuration, e.g. adaptive_k3='--speculative-algorithm EAGLE3 ...'",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=None)
    p.add_argument("--output-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--min-prompts", type=int, default=None, help="default: the preset's")
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--max-prompts", type=int, default=512)
    p.add_argument("--dataset", default=None, choices=["sharegpt", "mt-bench"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--chat-template", default=None, choices=["on", "off"])
    p.add_argument("--server-args", default="", help="flags appended to every configuration")
    p.add_argument("--model-path", default=None, help="replace the preset's --model-path")
    p.add_argument(
        "--draft-config-dir",
        default=None,
        help="dummy-draft presets: EAGLE-3 config dir to generate the draft from",
    )
    p.add_argument("--draft-out", default=None, help="dummy-draft presets: where to write it")
    p.add_argument("--config-budget-s", type=float, default=None)
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--log-dir", default="/tmp/sweep_serving_logs")
    p.add_argument("--result-file", default=None, help="default: results/sweep_<preset>.json")
    return p


def load_rows(server: Server, args: argparse.Namespace, n: int) -> list:
    """The sweep's prompts (bench_serving DatasetRow), tokenized with the server's tokenizer,
    optionally wrapped in its chat template."""
    from sglang.bench_serving import build_parser as bs_parser
    from sglang.bench_serving import load_tokenizer
    from sglang.benchmark.datasets import DatasetRow, get_dataset

    info = server.get("/get_model_info")
    tok = load_tokenizer(info["tokenizer_path"])
    ds_args = bs_parser().parse_args(
        ["--dataset-name", args.dataset, "--dataset-path", args.dataset_path]
        + ["--num-prompts", str(n), "--sharegpt-output-len", str(args.output_len)]
    )
    rows = get_dataset(ds_args, tok, info.get("context_length"))
    if args.chat_template == "on":
        out = []
        for r in rows:
            msgs = [{"role": "user", "content": r.prompt}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            n_tok = len(tok.encode(text, add_special_tokens=False))
            out.append(DatasetRow(text, n_tok, r.output_len))
        rows = out
    return rows


def run_point(server: Server, rows: list, c: int, timeout_s: float) -> dict[str, Any]:
    """bench_serving at max concurrency c over rows; the kept metrics (see KEEP_*)."""
    from sglang import bench_serving

    bargs = bench_serving.build_parser().parse_args(
        ["--base-url", server.url, "--num-prompts", str(len(rows))]
        + ["--max-concurrency", str(c), "--disable-tqdm", "--seed", "1"]
    )
    cpu0, wall0 = _cpu_seconds(server), time.perf_counter()
    res = asyncio.run(asyncio.wait_for(bench_serving.benchmark(bargs, rows, "default"), timeout_s))
    point = {k: res.get(k) for k in KEEP_METRICS}
    point["cpu_util"] = _cpu_util(cpu0, _cpu_seconds(server), time.perf_counter() - wall0)
    point["mean_in_flight"] = point.pop("concurrency")  # not the point's max concurrency
    for key in KEEP_MS:
        for stat in ("mean", "median", "p99"):
            point[f"{stat}_{key}_ms"] = res.get(f"{stat}_{key}_ms")
    point["failed"] = len(rows) - (res.get("completed") or 0)
    return point


def _cpu_seconds(server: Server) -> dict[str, float]:
    """CPU seconds so far of this benchmark process (`client`) and of the server's processes
    by role (proc_cpu.cpu_seconds_by_role: `http`, `scheduler`, `other`)."""
    return {"client": time.process_time(), **cpu_seconds_by_role(server.proc.pid)}


def _cpu_util(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Per role, CPU seconds over the point's wall seconds (1.0 = one core busy throughout): a
    role near 1.0 is what a single-threaded process can give, so the point measures it."""
    return {k: round((after[k] - before[k]) / max(wall_s, 1e-9), 3) for k in before}


def host_us_per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Microseconds per forward step the scheduler thread spent in each host phase
    (managers/host_phases.py: its cumulative host_s_<phase> keys) between two server states;
    {} when either lacks them or no step ran."""
    steps = after.get("forward_steps", 0) - before.get("forward_steps", 0)
    keys = [k for k in after if k.startswith("host_s_") and isinstance(before.get(k), float)]
    if steps <= 0 or not keys:
        return {}
    return {k[7:]: round(1e6 * (after[k] - before[k]) / steps, 1) for k in keys}


def gc_per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The scheduler process's garbage collections between two server states (utils/gc_stats.py:
    its cumulative gc_s_gen<g> / gc_collections_gen<g> keys): ``us`` microseconds per forward
    step in the collector (inside the host phases, not next to them) and ``gen<g>`` collections
    of each generation in the point; {} when either state lacks them or no step ran."""
    steps = after.get("forward_steps", 0) - before.get("forward_steps", 0)
    gens = [g for g in range(3) if isinstance(before.get(f"gc_s_gen{g}"), float)]
    if steps <= 0 or not gens or any(f"gc_s_gen{g}" not in after for g in gens):
        return {}
    seconds = sum(after[f"gc_s_gen{g}"] - before[f"gc_s_gen{g}"] for g in gens)
    out = {"us": round(1e6 * seconds / steps, 1)}
    for g in gens:
        k = f"gc_collections_gen{g}"
        out[f"gen{g}"] = after.get(k, 0) - before.get(k, 0)
    return out


def server_state(server: Server) -> dict[str, Any]:
    """Scalar entries of the scheduler's internal state, short lists and small dicts (the
    adaptive server's step-time coefficients and drafting steps by batch size; best effort)."""
    try:
        state = server.get("/get_server_info")["internal_states"][0]
    except Exception as e:  # noqa: BLE001
        return {"error": error_record(e)}
    return {
        k: v
        for k, v in state.items()
        if isinstance(v, int | float | str | bool) or (isinstance(v, list | dict) and len(v) <= 16)
    }


class Sweep:
    """The configurations of one preset, run one after another (see the module doc)."""

    def __init__(self, args: argparse.Namespace, preset: Preset, result: dict) -> None:
        self.args, self.preset, self.result = args, preset, result
        self.t_start = time.monotonic()
        self.deadline = self.t_start + args.deadline_s if args.deadline_s else float("inf")
        self.extra = {}
        for item in args.add_config:
            name, _, flags = item.partition("=")
            self.extra[name] = shlex.split(flags)
        self.rows: list | None = None
        self.drafted = False
        # the fastest start-up so far, to skip a start that cannot pay (the first server on a
        # fresh machine starts cold: 57-107 s against 27-50 s for the next ones on the H200,
        # and with the last start-up as the estimate a 107 s first start skipped the second
        # configuration of a same-call comparison that would have fitted)
        self.min_startup_s = 0.0

    def save(self) -> None:
        write_json(self.args.result_file, self.result)

    def num_prompts(self, c: int) -> int:
        a = self.args
        return min(max(a.min_prompts, a.prompts_per_concurrency * c), a.max_prompts)

    def run(self) -> None:
        os.makedirs(self.args.log_dir, exist_ok=True)
        for name in self.args.configs:
            flags = config_flags(self.preset, name, self.extra)
            flags += shlex.split(self.args.server_args)
            cfg: dict[str, Any] = {"name": name, "flags": flags, "points": []}
            self.result["configs"].append(cfg)
            if time.monotonic() + self.min_startup_s + MIN_POINT_S > self.deadline:
                cfg.update(status="skipped", reason="global deadline")
            else:
                try:
                    self.make_draft(flags)
                    self.run_config(cfg)
                except Exception as e:  # noqa: BLE001 - record, next configuration
                    cfg.update(status="error", error=error_record(e))
            self.save()

    def make_draft(self, flags: list[str]) -> None:
        """Generate the preset's dummy draft once, before the first speculative server."""
        if self.drafted or not self.preset.make_draft or "--speculative-algorithm" not in flags:
            return
        self.drafted = True
        src, dst = self.preset.make_draft
        script = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "make_dummy_eagle3_draft.py"
        )
        cmd = [sys.executable, script, "--config-dir", src, "--out", dst]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        info = {"command": " ".join(cmd), "rc": r.returncode, "s": time.monotonic() - t0}
        if r.returncode != 0:
            info["stderr"] = r.stderr[-3000:]
        self.result["dummy_draft"] = info

    def run_config(self, cfg: dict) -> None:
        """Start the server of one configuration, run its points, stop it."""
        args = self.args
        t0 = time.monotonic()
        log_path = os.path.join(args.log_dir, f"{args.preset}_{cfg['name']}.log")
        server = Server(cfg["flags"], log_path)
        cfg["command"] = server.shell_command()
        cfg["log"] = log_path
        try:
            try:
                # start-up (first-start kernel compilation, graph capture) is bounded by
                # --startup-timeout-s and the deadline; the config budget starts once it serves
                left = max(1.0, self.deadline - time.monotonic())
                server.wait_ready(min(args.startup_timeout_s, left))
                cfg["startup_s"] = startup = time.monotonic() - t0
                seen = self.min_startup_s
                self.min_startup_s = startup if seen == 0.0 else min(seen, startup)
                if self.rows is None:
                    n_max = max(self.num_prompts(c) for c in args.concurrency)
                    self.rows = load_rows(server, args, n_max)
                    self.result["num_rows"] = len(self.rows)
            except Exception as e:  # noqa: BLE001
                cfg.update(status="error", error="server start: " + error_record(e))
                cfg["log_tail"] = log_tail(log_path)
                return
            ready = time.monotonic()
            budget_end = ready + args.config_budget_s if args.config_budget_s else float("inf")
            end = min(self.deadline, budget_end)
            stop = None
            for c in args.concurrency:
                point = {"concurrency": c, "num_prompts": min(self.num_prompts(c), len(self.rows))}
                cfg["points"].append(point)
                left = end - time.monotonic()
                if stop or left < MIN_POINT_S:
                    reason = "global deadline" if self.deadline <= budget_end else "config budget"
                    point.update(status="skipped", reason=stop or reason)
                    continue
                stop = self.run_point(server, cfg["name"], point, left)
                if stop:
                    cfg["log_tail"] = log_tail(log_path)
                self.save()
            all_ok = all(p.get("status") == "ok" for p in cfg["points"])
            cfg["status"] = "ok" if all_ok else "partial"
        finally:
            server.stop()
            cfg["total_s"] = time.monotonic() - t0

    def run_point(self, server: Server, name: str, point: dict, left_s: float) -> str | None:
        """Run one point into `point`; returns why the configuration must stop, or None."""
        c, n = point["concurrency"], point["num_prompts"]
        point["flushed"] = server.flush_cache()
        before = server_state(server)
        t0 = time.monotonic()
        stop = None
        try:
            point.update(run_point(server, self.rows[:n], c, left_s))
            point["status"] = "ok"
        except (TimeoutError, asyncio.TimeoutError):
            point["status"] = "timeout"
            stop = "an earlier point timed out"
        except Exception as e:  # noqa: BLE001
            point.update(status="error", error=error_record(e))
            if server.proc.poll() is not None:
                stop = "server died"
        point["wall_s"] = time.monotonic() - t0
        if not stop:
            point["server_state"] = server_state(server)
            point["host_us_per_step"] = host_us_per_step(before, point["server_state"])
            point["gc_per_step"] = gc_per_step(before, point["server_state"])
        tput = point.get("output_throughput")
        print(
            f"[{self.args.preset}/{name} c={c}] {point['status']} output_tok_s={tput}",
            flush=True,
        )
        return stop


def resolve_args(args: argparse.Namespace) -> Preset:
    """Fill the preset's defaults into args; returns the preset."""
    preset = PRESETS[args.preset]
    if args.model_path:
        flags = list(preset.model_flags)
        if "--model-path" in flags:
            flags[flags.index("--model-path") + 1] = args.model_path
        else:
            flags += ["--model-path", args.model_path]
        preset = dataclasses.replace(preset, model_flags=flags)
    if preset.make_draft and (args.draft_config_dir or args.draft_out):
        src = args.draft_config_dir or preset.make_draft[0]
        dst = args.draft_out or preset.make_draft[1]
        draft_flags = ["--speculative-draft-model-path", dst]
        preset = dataclasses.replace(preset, make_draft=(src, dst), draft_flags=draft_flags)
    args.configs = args.configs or list(preset.configs)
    args.concurrency = args.concurrency or list(preset.concurrency)
    if min(args.concurrency) < 1:  # bench_serving reads 0 as "no limit"
        raise SystemExit(f"--concurrency values must be >= 1, got {args.concurrency}")
    args.output_len = args.output_len or preset.output_len
    args.min_prompts = args.min_prompts or preset.min_prompts
    args.dataset = args.dataset or preset.dataset
    if args.dataset_path is None:
        args.dataset_path = preset.dataset_path if args.dataset == preset.dataset else MTBENCH
    if args.chat_template is None:
        args.chat_template = "on" if preset.chat_template else "off"
    if args.result_file is None:
        args.result_file = os.path.join(RESULTS_DIR, f"sweep_{args.preset}.json")
    known = set(CONFIGS) | {item.partition("=")[0] for item in args.add_config}
    unknown = [c for c in args.configs if c not in known]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {sorted(known)}")
    return preset


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    preset = resolve_args(args)
    settings = {
        k: getattr(args, k)
        for k in (
            "preset",
            "configs",
            "concurrency",
            "output_len",
            "min_prompts",
            "prompts_per_concurrency",
            "max_prompts",
            "dataset",
            "dataset_path",
            "chat_template",
            "server_args",
            "config_budget_s",
            "deadline_s",
        )
    }
    settings["model_flags"] = preset.model_flags
    settings["draft"] = preset.make_draft
    settings["request_rate"] = "inf (all at once, at most c in flight)"
    settings["sampling"] = "greedy, ignore_eos, fixed output length"
    result: dict[str, Any] = {
        "meta": run_meta(["benchmark/sweep_serving.py"] + argv),
        "settings": settings,
        "configs": [],
    }
    sweep = Sweep(args, preset, result)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run finally:
    try:
        sweep.run()
    finally:
        result["total_s"] = time.monotonic() - sweep.t_start
        sweep.save()
    print(f"wrote {args.result_file}")
    return result


if __name__ == "__main__":
    sys.exit(exit_status(main()))
