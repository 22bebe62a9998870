"""How often an adaptive scheduler runs its goodput policy under churn, and what its host phases
cost against a plain scheduler's, for `recheck_margin` values (CPU machine, no GPU needed):

    python benchmark/profile_policy_runs.py --batch-sizes 2 8 --margins 0 0.8 \
        --result-file benchmark/results/policy_runs_cpu.json

Why: on the H200 the SmolLM2 adaptive server ran its policy on 3.5% of its steps at c = 2 and
4.8% at c = 8 (thirty-sixth session, `spec_policy_runs` per point in
paired_smollm2_h200_s36.json), nearly once per finished request. Below 8 requests any shrink
of the batch re-runs the policy (and, before the thirty-eighth session, reset the reuse
window; `recheck_shrink`), and there a
request finishes every ~128 / c steps. `recheck_margin` lets an all-zero choice whose bound
check put drafting far from paying (`spec_zero_bound_ratio` at most the margin; 0.21-0.74 in
those points) survive such shrinks until its window ends.

The load: the in-process Scheduler with overlap scheduling on, on a tiny random model and a
tiny EAGLE-3 draft (bench_common.tiny_target_and_draft), streamed greedy requests of
--output-lens output tokens (8-40 by default; 100-128 is closer to the serving benchmarks' 128)
topped up to the batch size before every step, --speculative-adaptive with a fixed step-time
model (online correction off): by default the coefficients the H200 SmolLM2 adaptive server
had fitted at c = 8 (thirty-sixth session, round 0 of that point), under which drafting does
not pay at these batch sizes. After a warm-up of 3 x batch-size steps the heap is frozen (as
the server does) and --steps-per-request x batch-size steps are measured: policy runs per
forward step, the last bound ratio, the request-steps that drafted, and the scheduler's host
phases `plan` (the policy runs inside it), `build`, `commit` and `flush` (HostPhases,
microseconds per step; left out: `launch`, which on the CPU holds the model's forward,
`resolve`, the wait for a step's result, and `recv`, the tokenizer's socket, absent in
process). A plain scheduler (no speculation) gives the baseline. Each configuration keeps each
phase's lowest value over the rounds (they alternate, each round on the same request stream).
"""

from __future__ import annotations

import argparse
import gc
import json

from bench_common import (
    TopUpLoad,
    append_run,
    git_commit_of_cwd,
    overlap_cpu_scheduler,
    tiny_target_and_draft,
)

PHASES = ("plan", "build", "commit", "flush")  # the scheduler's host phases reported

# The step-time coefficients (seconds per unit) of the SmolLM2 adaptive server on the H200 at
# c = 8, round 0 (paired_smollm2_h200_s36.json, server_state.spec_step_time_coef).
H200_SMOLLM2_C8 = {
    "const": 0.0013435,
    "bs": 5.0787e-06,
    "verify_tokens": 4.4422e-06,
    "draft_tokens": 1.8015e-06,
    "draft_steps": 0.00056854,
    "spec_on": 0.0028953,
    "kv_tokens": 1.8672e-08,
    "draft_reqs": 8.0203e-06,
    "long_catchup": 0.0043939,
}


def measure(
    model: str, kw: dict, bs: int, steps_per_request: int, seed: int, out_lens: tuple[int, int]
) -> dict:
    """One configuration at batch size bs, requests of out_lens[0]..out_lens[1] output tokens:
    see the module docstring for what is measured."""
    from sglang.test.scheduler_utils import run_until_idle

    s = overlap_cpu_scheduler(model, kw)
    run = TopUpLoad(s, bs, seed, out_lens).run

    run(3 * bs)
    gc.collect()
    gc.freeze()
    ctl = s.spec.adaptive if s.spec is not None else None
    runs0 = ctl.num_policy_runs if ctl is not None else 0
    steps0 = s.stats["forward_steps"]
    phases0 = dict(s.phases.seconds)
    drafting0 = s.spec.stats["spec_drafting_steps"] if s.spec is not None else 0
    run(steps_per_request * bs)
    gc.unfreeze()
    steps = s.stats["forward_steps"] - steps0
    out = {
        "steps": steps,
        **{
            f"{k}_us_per_step": round(1e6 * (s.phases.seconds[k] - phases0[k]) / steps, 1)
            for k in PHASES
        },
    }
    if ctl is not None:
        info = ctl.info()
        out["policy_runs_per_step"] = round((ctl.num_policy_runs - runs0) / steps, 4)
        ratio = info.get("spec_zero_bound_ratio")
        out["zero_bound_ratio"] = None if ratio is None else round(float(ratio), 4)
        out["drafting_steps"] = s.spec.stats["spec_drafting_steps"] - drafting0
    run_until_idle(s, {})
    if s.worker_client is not None:
        s.worker_client.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 8])
    p.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--steps-per-request", type=int, default=60)
    p.add_argument(
        "--output-lens",
        type=int,
        nargs=2,
        default=[8, 40],
        help="each request's output tokens, uniform in this range (inclusive)",
    )
    p.add_argument("--rounds", type=int, default=3, help="configurations alternate per round")
    p.add_argument(
        "--time-model",
        default=None,
        help="JSON step-time coefficients (default: the H200 SmolLM2 fit at c = 8)",
    )
    p.add_argument(
        "--extra-config",
        default=None,
        help="JSON object merged into every adaptive configuration's "
        "--speculative-adaptive-config (e.g. '{\"initial_accept\": 0.5}')",
    )
    p.add_argument("--label", default="current tree")
    p.add_argument("--result-file", default=None)
    a = p.parse_args(argv)
    if a.steps_per_request < 1 or a.rounds < 1 or min(a.batch_sizes) < 1:
        p.error("--steps-per-request, --rounds and --batch-sizes must be >= 1")
    if not 1 <= a.output_lens[0] <= a.output_lens[1]:
        p.error(f"--output-lens needs 1 <= low <= high, got {a.output_lens}")
    if len({f"{m:g}" for m in a.margins}) < len(a.margins):
        p.error(f"--margins names a value twice: {a.margins}")
    if any(not 0 <= m <= 0.99 for m in a.margins):
        p.error(f"--margins must lie in [0, 0.99] (recheck_margin's range), got {a.margins}")
    coef = H200_SMOLLM2_C8
    if a.time_model is not None:
        try:
            coef = json.loads(a.time_model)
        except json.JSONDecodeError as e:
            p.error(f"--time-model is not JSON: {e}")
        from sglang.srt.speculative.adaptive.registry import parse_adaptive_config

        try:  # what the server would refuse (unknown features, negative coefficients, ...)
            parse_adaptive_config(json.dumps({"time_model": coef}))
        except ValueError as e:
            p.error(f"--time-model: {e}")
    extra = {}
    if a.extra_config is not None:
        from sglang.srt.speculative.adaptive.registry import parse_adaptive_config

        try:
            extra = json.loads(a.extra_config)
            parse_adaptive_config(json.dumps(extra))  # what the server would refuse
        except ValueError as e:  # (json.JSONDecodeError is a ValueError)
            p.error(f"--extra-config: {e}")
        if not isinstance(extra, dict):
            p.error(f"--extra-config must be a JSON object, got {a.extra_config!r}")
    model, draft = tiny_target_and_draft()
    configs: dict[str, dict] = {"plain": {}}
    for m in a.margins:
        cfg = {**extra, "time_model": coef, "online_correction": False, "recheck_margin": m}
        configs[f"margin_{m:g}"] = dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft,
            speculative_num_steps=5,
            speculative_adaptive=True,
            speculative_adaptive_config=json.dumps(cfg),
        )
    per_bs: dict[str, dict] = {}
    for bs in a.batch_sizes:
        rounds: dict[str, list[dict]] = {name: [] for name in configs}
        for r in range(a.rounds):
            for name, kw in configs.items():  # the same request stream (seed r) for each
                rounds[name].append(
                    measure(model, kw, bs, a.steps_per_request, r, tuple(a.output_lens))
                )
        summary = {}
        for name, rs in rounds.items():
            summary[name] = {
                f"{k}_us_per_step_min": min(x[f"{k}_us_per_step"] for x in rs) for k in PHASES
            }
            if "policy_runs_per_step" in rs[0]:
                summary[name]["policy_runs_per_step"] = [x["policy_runs_per_step"] for x in rs]
                summary[name]["zero_bound_ratio"] = [x["zero_bound_ratio"] for x in rs]
                summary[name]["drafting_steps"] = [x["drafting_steps"] for x in rs]
            print(f"bs {bs} {name}: {summary[name]}", flush=True)
        per_bs[f"bs{bs}"] = {"summary": summary, "rounds": rounds}
    result = {
        "label": a.label,
        "git_commit_of_cwd": git_commit_of_cwd(),
        "settings": {
            "steps_per_request": a.steps_per_request,
            "rounds": a.rounds,
            "output_lens": a.output_lens,
            "time_model": coef,
            "extra_config": extra,
        },
        "results": per_bs,
    }
    if a.result_file:
        append_run(a.result_file, "python benchmark/profile_policy_runs.py", result)
    return result


if __name__ == "__main__":
    main()
