"""Host (CPU) cost of sending a decode step's outputs, without a GPU:

    python benchmark/profile_output_host.py --label current \
        --result-file benchmark/results/output_host_cpu.json

The in-process Scheduler on a tiny random model (tiny EAGLE-3 draft for mode `adaptive`, with a
fixed step-time model under which nothing drafts), --batch-size streamed greedy requests of 300
tokens. After --warm-steps steps, for --steps steps: microseconds per step in
OutputProcessor.flush (incremental detokenization and the BatchStrOut message) and in pickling
that message (what the server's ZMQ send does to it). The scheduler thread is GIL-bound on the
GPU host, so this is per-step time of the scheduler thread there.

Run it with PYTHONPATH=<a worktree of another commit>/python to measure that commit (the script
only uses interfaces that have not changed); each run is appended to --result-file.
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time

import torch
from bench_common import append_run, git_commit_of_cwd


def flush_us(mode: str, bs: int, warm_steps: int, steps: int) -> dict:
    from sglang.test.scheduler_utils import make_scheduler, submit
    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir
    from sglang.test.tiny_models import make_tiny_model_dir

    torch.set_num_threads(1)
    d = tempfile.mkdtemp()
    model = make_tiny_model_dir(d + "/m")
    kw = {}
    if mode == "adaptive":
        never = {"time_model": {"verify_tokens": 1.0}, "online_correction": False}
        kw = dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=make_tiny_eagle3_dir(d + "/e", model),
            speculative_num_steps=3,
            speculative_adaptive=True,
            speculative_adaptive_config=json.dumps(never),
        )
    s = make_scheduler(model, device="cpu", dtype="float32", max_total_tokens=65536, **kw)
    outputs = s.outputs
    flush = outputs.flush
    acc = {"flush": 0.0, "pickle": 0.0, "calls": 0}

    def timed_flush() -> None:
        t0 = time.perf_counter()
        flush()
        t1 = time.perf_counter()
        for msg in outputs.local_outbox:
            pickle.dumps(msg)
        acc["flush"] += t1 - t0
        acc["pickle"] += time.perf_counter() - t1
        acc["calls"] += 1
        outputs.local_outbox.clear()

    outputs.flush = timed_flush
    params = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    for i in range(bs):
        submit(s, f"r{i}", list(range(10, 40)), params, stream=True)
    for _ in range(warm_steps):
        s.step()
    acc.update(flush=0.0, pickle=0.0, calls=0)
    for _ in range(steps):
        s.step()
    n = max(1, acc["calls"])
    return {
        "flush_us_per_step": round(1e6 * acc["flush"] / n, 1),
        "pickle_us_per_step": round(1e6 * acc["pickle"] / n, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warm-steps", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--label", default="current")
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    import sglang

    result = {
        "label": a.label,
        "sglang_path": sglang.__file__,
        "git_commit_of_cwd": git_commit_of_cwd(),
        "settings": {"batch_size": a.batch_size, "warm_steps": a.warm_steps, "steps": a.steps},
        "no_spec": flush_us("no_spec", a.batch_size, a.warm_steps, a.steps),
        "adaptive": flush_us("adaptive", a.batch_size, a.warm_steps, a.steps),
    }
    print(json.dumps(result, indent=1))
    if a.result_file:
        append_run(a.result_file, "python benchmark/profile_output_host.py", result)


if __name__ == "__main__":
    main()
