"""Does the adaptive warm-up sweep slow the scheduler's later Python work (the heap it leaves
before gc.freeze)? CPU, in-process, the tiny model and draft on the CUDA-like path
(count_step_ops.cuda_like_scheduler), adaptive speculation with nothing drafting:

    python benchmark/profile_warmup_heap.py cold   # no warm-up sweep (what CPU servers do)
    python benchmark/profile_warmup_heap.py warm   # the sweep first (profile_on_worker)

Then the heap is frozen as the server does, and streamed greedy requests of 8-40 tokens are
topped up to 16 before every step. Prints, for 5 blocks of 600 steps, the microseconds per
step of three pure-Python phases: build (get_next_batch_to_run), commit
(process_batch_result) and flush. Run the two modes alternately, pinned to one core.
"""

from __future__ import annotations

import json
import random
import sys
import time

from bench_common import PhaseTimers, tiny_target_and_draft
from count_step_ops import cuda_like_scheduler

from sglang.srt.utils.process import freeze_gc
from sglang.test.scheduler_utils import collect, submit


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("cold", "warm"):
        raise SystemExit("usage: profile_warmup_heap.py cold|warm")
    model, draft = tiny_target_and_draft()
    cfg = {"profile_batch_sizes": [1, 4, 16, 64], "online_correction": False}
    kw = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=3,
        speculative_adaptive=True,
        speculative_adaptive_config=json.dumps(cfg),
    )
    s = cuda_like_scheduler(model, kw, [1, 2, 4, 8, 16, 24, 32])
    if mode == "warm":
        from sglang.srt.speculative.adaptive.warmup import profile_on_worker

        t = time.perf_counter()
        profile_on_worker(s, s.spec.adaptive, context_len=256)
        print(f"warm-up sweep {time.perf_counter() - t:.1f} s")
    s.spec.choose_draft_lens = lambda reqs: [0] * len(reqs)  # nothing drafts
    freeze_gc("profile_warmup_heap")
    rng = random.Random(0)
    outs: dict = {}
    n = 0

    def top_up() -> None:
        nonlocal n
        while len(s.running) + len(s.waiting_queue) < 16:
            ids = [rng.randrange(5, 200) for _ in range(20)]
            params = {"max_new_tokens": rng.randrange(8, 40), "temperature": 0, "ignore_eos": True}
            submit(s, f"r{n}", ids, params, stream=True)
            n += 1

    def run(steps: int) -> None:
        for _ in range(steps):
            top_up()
            s.step()
            collect(s, outs)
            s.outputs.local_outbox.clear()

    timers = PhaseTimers(
        [
            (s.builder, "get_next_batch_to_run", "build"),
            (s.outputs, "process_batch_result", "commit"),
            (s.outputs, "flush", "flush"),
        ]
    )
    run(300)
    blocks = []
    for _ in range(5):
        timers.take()
        run(600)
        blocks.append({k: round(1e3 * v / 600, 1) for k, v in timers.take().items()})
    print(mode, "us per step:", json.dumps(blocks))


if __name__ == "__main__":
    main()
