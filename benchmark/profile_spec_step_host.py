"""Host cost of a speculative decode step against a plain one, without a GPU:

    python benchmark/profile_spec_step_host.py --label L \
        --result-file benchmark/results/spec_step_host_cpu.json

The in-process Scheduler on the tiny random test model and its tiny EAGLE-3 draft (CPU,
float32, one thread), --batch-size greedy requests of 30 prompt tokens; after 10 warm-up steps,
wall ms per scheduler step over --steps steps, without speculation and with a static K
(--k, every step drafts K tokens per request; the random draft's tokens are rejected, so each
step commits one token). The models are tiny, so the step time is mostly host work: Python
and the launch of each tensor op, which on a GPU become per-step host overhead. With
--top N, the N functions with the most own time under cProfile (a separate run).

To measure another commit, run it from a worktree of that commit with PYTHONPATH=python (the
run records the checkout's commit). Results are appended to --result-file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shlex
import sys
import time

import torch
from bench_common import append_run, git_commit_of_cwd, tiny_target_and_draft


def step_ms(model: str, spec: dict, bs: int, steps: int, top: int) -> tuple[float, str]:
    """Wall ms per scheduler step over `steps` timed steps (after 10 warm-up steps) of `bs`
    greedy requests; with top > 0 the steps run under cProfile and the second value is its
    `top` functions by own time (else "")."""
    from sglang.test.scheduler_utils import make_scheduler, submit

    s = make_scheduler(model, device="cpu", dtype="float32", max_total_tokens=65536, **spec)
    params = {"max_new_tokens": 10 + steps * 5, "temperature": 0, "ignore_eos": True}
    for i in range(bs):
        submit(s, f"r{i}", list(range(10 + i, 40 + i)), params)
    for _ in range(10):
        s.step()
    prof = cProfile.Profile() if top > 0 else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        s.step()
    if prof is not None:
        prof.disable()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    text = ""
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        text = out.getvalue()
    return ms, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="best of N timed windows")
    p.add_argument("--top", type=int, default=0, help="print the cProfile top N (own time)")
    p.add_argument("--label", default="")
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    model, draft = tiny_target_and_draft()
    torch.set_grad_enabled(False)
    cfgs = {
        "plain": {},
        f"static_k{a.k}": dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft,
            speculative_num_steps=a.k,
        ),
    }
    run = {"label": a.label, "git_commit": git_commit_of_cwd(), "batch_size": a.batch_size}
    for name, spec in cfgs.items():
        best = min(step_ms(model, spec, a.batch_size, a.steps, 0)[0] for _ in range(a.repeats))
        run[f"{name}_ms_per_step"] = round(best, 3)
        print(f"{name}: {best:.3f} ms per step", flush=True)
        if a.top:
            print(step_ms(model, spec, a.batch_size, a.steps, a.top)[1])
    if a.result_file:
        append_run(a.result_file, "python " + shlex.join(sys.argv), run)


if __name__ == "__main__":
    main()
