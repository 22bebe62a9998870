"""Where an adaptive server's scheduler thread spends more host time than a plain one, per
function, from cProfile of the in-process Scheduler (CPU machine, no GPU needed):

    python benchmark/profile_host_diff.py --batch-size 64 [--steps-per-request 12] \
        --label L --result-file benchmark/results/host_diff_cpu.json

Both configurations of bench_common.plain_and_adaptive_no_drafts (no speculation, and EAGLE-3
--speculative-adaptive under a step-time model where drafting never pays: the common case under
load) run the same serving-like load on count_step_ops.cuda_like_scheduler (overlap scheduling
on, the CUDA-graph runners run eagerly over their padded batches: the path a CUDA server
takes), streamed greedy requests of 8-40 output tokens topped up to --batch-size before every
step, so that requests finish and join nearly every step. After a warm-up of 3 x batch-size
steps the heap is frozen (gc.freeze, as the server does after start-up: otherwise collections
land in whichever function allocates) and cProfile records --steps-per-request x batch-size
steps.

Reported per configuration: forward steps (prefill and decode) and prefill steps, and per
function (module:name) microseconds per step of own time (tottime) and with callees
(cumtime) and calls per step; then the functions whose own time grew or shrank most, and
`policy_runs_per_step` (AdaptiveController._run_policy calls per forward step). The tiny
model's own forward is real CPU compute here (on a GPU host it is kernel launches), so
compare the scheduler's functions, not totals.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats

from bench_common import (
    TopUpLoad,
    append_run,
    git_commit_of_cwd,
    plain_and_adaptive_no_drafts,
    tiny_target_and_draft,
)
from count_step_ops import cuda_like_scheduler

# The scheduler step's phases and the adaptive server's own parts (module:function).
PHASES = (
    "srt/managers/batch_builder.py:get_next_batch_to_run",
    "srt/managers/batch_builder.py:build_model_worker_batch",
    "srt/managers/tp_worker_overlap_thread.py:forward_batch_generation_async",
    "srt/managers/scheduler.py:commit",
    "srt/managers/scheduler_output_processor.py:flush",
    "srt/managers/spec_scheduler.py:choose_draft_lens",
    "srt/managers/spec_scheduler.py:commit_decode",
    "srt/speculative/adaptive/controller.py:observe",
)


def profile(model: str, kw: dict, bs: int, steps_per_request: int) -> dict:
    s = cuda_like_scheduler(model, kw, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    run = TopUpLoad(s, bs, seed=0, out_lens=(8, 40)).run

    run(3 * bs)
    gc.collect()
    gc.freeze()
    before = dict(s.stats)
    prof = cProfile.Profile()
    prof.enable()
    run(steps_per_request * bs)
    prof.disable()
    gc.unfreeze()
    steps = s.stats["forward_steps"] - before["forward_steps"]
    funcs: dict[str, dict] = {}
    for (path, _line, name), (_cc, nc, tt, ct, _callers) in pstats.Stats(prof).stats.items():
        key = f"{path.rsplit('/sglang/', 1)[-1]}:{name}"
        f = funcs.setdefault(key, {"tottime_us": 0.0, "cumtime_us": 0.0, "calls": 0.0})
        f["tottime_us"] += 1e6 * tt / steps
        f["cumtime_us"] += 1e6 * ct / steps
        f["calls"] += nc / steps
    if s.worker_client is not None:
        s.worker_client.shutdown()
    return {
        "steps": steps,
        "prefill_steps": s.stats["prefill_steps"] - before["prefill_steps"],
        "functions": {k: {n: round(v, 2) for n, v in f.items()} for k, f in funcs.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps-per-request", type=int, default=12)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--label", default="current tree")
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    model, draft = tiny_target_and_draft()
    runs = {
        name: profile(model, kw, a.batch_size, a.steps_per_request)
        for name, kw in plain_and_adaptive_no_drafts(draft).items()
    }
    plain, adaptive = (runs[n]["functions"] for n in ("plain", "adaptive_no_drafts"))
    zero = {"tottime_us": 0.0, "cumtime_us": 0.0, "calls": 0.0}
    delta = {
        k: round(adaptive.get(k, zero)["tottime_us"] - plain.get(k, zero)["tottime_us"], 2)
        for k in set(plain) | set(adaptive)
    }
    ranked = sorted(delta.items(), key=lambda kv: -kv[1])
    policy = adaptive.get("srt/speculative/adaptive/controller.py:_run_policy", zero)
    result = {
        "label": a.label,
        "git_commit_of_cwd": git_commit_of_cwd(),
        "batch_size": a.batch_size,
        "steps": {n: r["steps"] for n, r in runs.items()},
        "prefill_steps": {n: r["prefill_steps"] for n, r in runs.items()},
        "policy_runs_per_step": round(policy["calls"], 3),
        "grew_us_per_step": dict(ranked[: a.top]),
        "shrank_us_per_step": dict(sorted(ranked[-a.top :], key=lambda kv: kv[1])),
        "cumtime_us_per_step": {
            n: {
                k: round(runs[n]["functions"][k]["cumtime_us"], 1)
                for k in PHASES
                if k in runs[n]["functions"]
            }
            for n in runs
        },
    }
    for k, v in ranked[: a.top]:
        print(f"{v:+9.1f} us/step  {k}")
    print("policy runs per step:", result["policy_runs_per_step"])
    if a.result_file:
        append_run(a.result_file, "python benchmark/profile_host_diff.py", result)


if __name__ == "__main__":
    main()
