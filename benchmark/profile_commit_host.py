"""Host (CPU) cost of committing and sending a decode step at high concurrency, without a GPU:

    python benchmark/profile_commit_host.py --batch-size 128 --label L \
        --result-file benchmark/results/commit_host_cpu.json

The in-process Scheduler on a tiny random model (tiny EAGLE-3 draft for `adaptive_no_drafts`,
under a fixed step-time model where drafting never pays, or with --online one that learns
online from a prior where it never pays: every step is a plain decode, the common case under
load), --batch-size streamed greedy requests. Per configuration, after 3 steps, the median
(and, as `<phase>_mean`, the mean) ms per step over --steps steps of the scheduler's host
phases: `plan` (BatchBuilder.get_next_batch_to_run: the batch and,
speculative, the draft lengths), `build` (build_model_worker_batch), `commit`
(OutputProcessor.process_batch_result: tokens, KV lengths, and on the speculative server its
counters and pending hidden states) and `flush` (detokenization and the BatchStrOut message).
The adaptive configuration also reports `adaptive_calls`: its controller's policy runs and its
step-time model's re-solves, ms per call where the scheduler makes them (caches cold) and how
many over the steps (of the round with the fewest ms per call).
The two configurations alternate for --rounds rounds and the minimum over rounds is kept, as
this machine's speed drifts by up to 1.7x between runs. On the GPU host these run on the
scheduler thread between launches, so at high concurrency they are part of every step's time.

Run it with PYTHONPATH=<a worktree of another commit>/python to measure that commit; each run
is appended to --result-file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_common import (
    append_run,
    git_commit_of_cwd,
    plain_and_adaptive_no_drafts,
    tiny_target_and_draft,
)

PHASES = ("plan", "build", "commit", "flush")


def time_method(obj: object, meth: str, sink: list[float]) -> None:
    """Replace obj.meth with a wrapper that appends each call's wall seconds to `sink`."""
    real = getattr(obj, meth)

    def timed(*a, **k):
        t0 = time.perf_counter()
        r = real(*a, **k)
        sink.append(time.perf_counter() - t0)
        return r

    setattr(obj, meth, timed)


def commit_ms(model: str, kw: dict, bs: int, steps: int) -> dict[str, float]:
    """Median ms per step of each phase (PHASES) for one configuration."""
    from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

    s = make_scheduler(model, device="cpu", dtype="float32", max_total_tokens=65536, **kw)
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    time_method(s.builder, "get_next_batch_to_run", times["plan"])
    time_method(s.builder, "build_model_worker_batch", times["build"])
    time_method(s.outputs, "process_batch_result", times["commit"])
    time_method(s.outputs, "flush", times["flush"])
    # the adaptive controller's rare calls, each timed where the scheduler makes it (caches
    # cold after the plain steps between them): its policy runs and the step-time model's
    # re-solves
    calls: dict[str, list[float]] = {}
    if s.spec is not None and s.spec.adaptive is not None:
        ctl = s.spec.adaptive
        calls = {"policy_run": [], "solve": []}
        time_method(ctl, "_run_policy", calls["policy_run"])
        time_method(ctl.time_model, "_solve", calls["solve"])
    params = {"max_new_tokens": steps + 8, "temperature": 0, "ignore_eos": True}
    for i in range(bs):
        submit(s, f"r{i}", list(range(10, 40)), params, stream=True)
    for _ in range(3):
        s.step()
    for v in [*times.values(), *calls.values()]:
        v.clear()
    for _ in range(steps):
        s.step()
    out = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()}
    # the mean too: work done once in n steps (e.g. deferred observations) moves it, not the
    # median
    out.update({f"{k}_mean": round(1e3 * statistics.mean(v), 4) for k, v in times.items()})
    for k, v in calls.items():  # ms per call (mean) and calls over the timed steps
        out[f"{k}_ms"] = round(1e3 * statistics.mean(v), 4) if v else 0.0
        out[f"{k}s"] = len(v)
    run_until_idle(s, {})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--label", default="current")
    p.add_argument("--result-file", default=None)
    p.add_argument(
        "--online",
        action="store_true",
        help="the adaptive step-time model learns online (the default of a server) from a "
        "prior under which drafting never pays, instead of fixed coefficients: its periodic "
        "re-solves then count",
    )
    args = p.parse_args(argv)
    model, draft = tiny_target_and_draft()
    cfgs = plain_and_adaptive_no_drafts(draft)
    if args.online:
        cfgs["adaptive_no_drafts"]["speculative_adaptive_config"] = json.dumps(
            {"time_model": {"verify_tokens": 1.0}}
        )
    rounds: dict[str, list[dict]] = {name: [] for name in cfgs}
    for _ in range(args.rounds):
        for name, kw in cfgs.items():
            rounds[name].append(commit_ms(model, kw, args.batch_size, args.steps))
    keys = [*PHASES, *(f"{k}_mean" for k in PHASES)]
    best = {name: {k: min(r[k] for r in rs) for k in keys} for name, rs in rounds.items()}
    plain = best["plain"]
    # the adaptive controller's rare calls: ms per call and count, of the round with the
    # fewest ms per call
    calls = {}
    for key in ("policy_run", "solve"):
        rs = rounds["adaptive_no_drafts"]
        r = min(rs, key=lambda x, _k=key: x.get(f"{_k}_ms", 0.0))
        calls[key] = {"ms_per_call": r.get(f"{key}_ms", 0.0), "calls": r.get(f"{key}s", 0)}
    result = {
        "label": args.label,
        "sglang_path": __import__("sglang").__file__,
        "git_commit_of_cwd": git_commit_of_cwd(),
        "settings": {
            "batch_size": args.batch_size,
            "steps": args.steps,
            "rounds": args.rounds,
            "online": args.online,
        },
        "ms_per_step_min_over_rounds": best,
        "adaptive_calls": calls,
        "adaptive_minus_plain_ms": {
            k: round(best["adaptive_no_drafts"][k] - plain[k], 4) for k in plain
        },
        "rounds": rounds,
    }
    print(result["label"], best, result["adaptive_minus_plain_ms"], flush=True)
    if args.result_file:
        cmd = (
            "python benchmark/profile_commit_host.py --batch-size N --label L --result-file "
            "benchmark/results/commit_host_cpu.json (PYTHONPATH=<worktree>/python for older trees)"
        )
        append_run(args.result_file, cmd, result)
    return result


if __name__ == "__main__":
    main()
