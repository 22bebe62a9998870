"""Host (CPU) cost of adaptive speculation's per-step work, without a GPU:

    python benchmark/profile_adaptive_host.py --result-file benchmark/results/adaptive_host_cpu.json

- policy: one GoodputPolicy.choose at batch 1 / 64 / 256 (5 draft positions, random
  acceptance) under the default step-time prior and under a heavy model where drafting cannot
  pay (the common case under load), ms per call;
- observe: AdaptiveController.observe of a step where nothing drafts, us per call;
- scheduler: the in-process Scheduler on a tiny random model (tiny EAGLE-3 draft), batch
  --batch-size, 48 tokens per request, plain vs --speculative-adaptive with a fixed model under
  which nothing drafts; ms per decode step of each scheduler phase (plan / build / commit /
  flush, wall time of the calls), so the difference is the speculative bookkeeping of plain
  steps; `worker`: the worker's forward call (on this machine mostly the tiny model's CPU
  forward, so not the GPU host's launch cost);
  `_staggered`: the same with requests of 8-40 tokens topped up to the batch size every step
  (requests join and finish nearly every step, as under serving load; prefills included).
  `adaptive_no_drafts_eager_extend`: adaptive with `defer_draft_extend` false, so its
  prefills run the draft extend as before f6a9fd1.

Run it with PYTHONPATH=<a worktree of another commit>/python to measure that commit (the
script only uses interfaces that have not changed).
"""

from __future__ import annotations

import argparse
import json
import timeit

import numpy as np
from bench_common import (
    PhaseTimers,
    append_run,
    git_commit_of_cwd,
    plain_and_adaptive_no_drafts,
    tiny_target_and_draft,
)


def policy_ms() -> dict:
    from sglang.srt.speculative.adaptive.policy import BatchView, GoodputPolicy
    from sglang.srt.speculative.adaptive.step_time_model import FEATURES, StepTimeModel

    heavy = {f: 0.0 for f in FEATURES}
    heavy.update(const=2e-3, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4, spec_on=3e-4)
    models = {"default_prior": StepTimeModel({}), "heavy": StepTimeModel(heavy, online=False)}
    out = {}
    for n in (1, 64, 256):
        rng = np.random.default_rng(0)
        v = BatchView(
            caps=np.full(n, 5),
            alphas=rng.uniform(0.3, 0.9, size=(n, 5)),
            pending=np.ones(n, dtype=np.int64),
            prev=np.full(n, -1),
            kv_tokens=n * 300,
        )
        for name, m in models.items():
            p = GoodputPolicy()
            t = min(
                timeit.repeat(lambda p=p, m=m, v=v: p.choose(v, m.predict), number=20, repeat=3)
            )
            out[f"bs{n}_{name}"] = round(1e3 * t / 20, 4)
    return out


def observe_us() -> dict:
    from types import SimpleNamespace

    from sglang.srt.speculative.adaptive.controller import AdaptiveController
    from sglang.srt.speculative.adaptive.registry import parse_adaptive_config

    out = {}
    for n in (1, 16, 64, 256):
        c = AdaptiveController(parse_adaptive_config(None), 5, 512)
        reqs = [
            SimpleNamespace(
                req_pool_idx=i, kv_len=100, draft=SimpleNamespace(draft_kv_len=99, stale=False)
            )
            for i in range(n)
        ]
        zeros, step = [0] * n, [0]

        def one(c=c, reqs=reqs, zeros=zeros, step=step):
            step[0] += 1
            c.observe(reqs, zeros, zeros, 1e-3, step[0])

        out[f"bs{n}"] = round(1e6 * min(timeit.repeat(one, number=500, repeat=3)) / 500, 2)
    return out


def scheduler_ms(bs: int, staggered: bool = False) -> dict:
    from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

    model, draft = tiny_target_and_draft()
    cfgs = plain_and_adaptive_no_drafts(draft)
    # the same with prefills running the draft extend (as before the deferred draft extend)
    eager = dict(cfgs["adaptive_no_drafts"])
    cfg = json.loads(eager["speculative_adaptive_config"])
    eager["speculative_adaptive_config"] = json.dumps({**cfg, "defer_draft_extend": False})
    cfgs["adaptive_no_drafts_eager_extend"] = eager
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    out = {}
    for name, kw in cfgs.items():
        s = make_scheduler(model, device="cpu", dtype="float32", max_total_tokens=65536, **kw)
        timers = PhaseTimers(
            [
                (s.builder, "get_next_batch_to_run", "plan"),
                (s.builder, "build_model_worker_batch", "build"),
                (s.outputs, "process_batch_result", "commit"),
                (s.tp_worker, "forward_batch_generation", "worker"),
                (s.outputs, "flush", "flush"),
            ]
        )
        n0 = 0
        if staggered:  # requests of 8-40 tokens, topped up to bs every step (serving-like)
            rng = np.random.default_rng(0)
            for k in range(24 * bs):
                while len(s.running) + len(s.waiting_queue) < bs:
                    p = dict(params, max_new_tokens=int(rng.integers(8, 41)))
                    submit(s, f"s{k}_{len(s.waiting_queue)}", list(range(10, 40)), p)
                s.step()
                if k == 2 * bs:
                    timers.take()
                    n0 = s.stats["forward_steps"]
            run_until_idle(s, {})
        for rep in range(0 if staggered else 3):
            for i in range(bs):
                submit(s, f"r{rep}_{i}", list(range(10, 40)), params)
            s.step()
            s.step()
            if rep == 0:
                timers.take()
                n0 = s.stats["forward_steps"]
            run_until_idle(s, {})
        steps = s.stats["forward_steps"] - n0
        out[name] = {k: round(v / steps, 4) for k, v in timers.take().items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--label", default="current")
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    result = {
        "label": a.label,
        "git_commit_of_cwd": git_commit_of_cwd(),
        "policy_ms": policy_ms(),
        "observe_us": observe_us(),
        f"scheduler_ms_per_step_bs{a.batch_size}": scheduler_ms(a.batch_size),
        f"scheduler_ms_per_step_bs{a.batch_size}_staggered": scheduler_ms(a.batch_size, True),
    }
    print(json.dumps(result, indent=1))
    if a.result_file:
        append_run(a.result_file, "python benchmark/profile_adaptive_host.py", result)


if __name__ == "__main__":
    main()
