"""What a full garbage collection costs the scheduler process, before and after freeze_gc:

    python benchmark/profile_gc_pause.py --result-file benchmark/results/gc_pause_cpu.json

Builds the in-process Scheduler of the bundled SmolLM2-135M-Instruct on the CPU (model,
tokenizer, pools: what the scheduler process holds after start-up), then times gc.collect()
(a full, generation-2 collection, the one Python runs now and then while serving) --repeats
times, calls sglang's freeze_gc (what run_scheduler_process does before it reports ready) and
times it again. Reports the number of tracked objects and the milliseconds per collection.
"""

from __future__ import annotations

import argparse
import gc
import time

from bench_common import run_meta, write_json


def full_collections_ms(repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        out.append(round(1e3 * (time.perf_counter() - t), 2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    from sglang.srt.utils.process import freeze_gc
    from sglang.test.scheduler_utils import make_scheduler

    sched = make_scheduler(None, device="cpu", max_total_tokens=4096)
    before = {"tracked_objects": len(gc.get_objects()), "ms": full_collections_ms(a.repeats)}
    frozen = freeze_gc("profile_gc_pause")
    after = {"tracked_objects": len(gc.get_objects()), "ms": full_collections_ms(a.repeats)}
    result = {
        "meta": run_meta(),
        "frozen_objects": frozen,
        "before_freeze": before,
        "after_freeze": after,
    }
    print(result["frozen_objects"], before, after)
    if a.result_file:
        write_json(a.result_file, result)
    del sched


if __name__ == "__main__":
    main()
