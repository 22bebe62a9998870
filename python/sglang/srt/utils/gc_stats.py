"""Time the process spends in Python's cyclic garbage collector, per generation.

Why: in paired serving runs on the H200 (benchmark/README.md, twenty-first session) the adaptive
server's scheduler thread at c = 256 spent about 1.5x the plain server's time per step in
*every* host phase, recv and flush included, whose code is the same in both servers. A slowdown
spread over all phases in proportion is what collections look like: they run inside whichever
phase allocated the object that tripped a threshold. The host phases (host_phases.py) cannot
tell; these counters can, at the cost of two time.perf_counter() calls per collection.

The collector runs on whichever thread allocates, so the counts are the whole process's (the
scheduler process: its scheduler thread, and the worker thread with SGLANG_OVERLAP_THREAD=1).
Collection time lies inside the host phases, not next to them.
"""

from __future__ import annotations

import gc
import time


class GcTimer:
    """Cumulative collections and seconds per generation (0, 1, 2) from gc.callbacks."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start: float | None = None

    def callback(self, phase: str, info: dict) -> None:
        """gc.callbacks entry: phase "start" or "stop"; info["generation"] in 0..2."""
        if phase == "start":
            self._start = time.perf_counter()
            return
        if self._start is None:  # installed during a collection
            return
        gen = info.get("generation", 2)
        self.seconds[gen] += time.perf_counter() - self._start
        self.collections[gen] += 1
        self._start = None

    def reset(self) -> None:
        """Zero the counters (a server calls it after freeze_gc: its start-up collection, some
        hundred milliseconds over the model's objects, is not a pause of serving)."""
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]

    def info(self) -> dict[str, float | int]:
        """Server-info keys: ``gc_s_gen<g>`` (seconds since install or reset, float) and
        ``gc_collections_gen<g>`` (int) for g = 0, 1, 2."""
        out: dict[str, float | int] = {}
        for g in range(3):
            out[f"gc_s_gen{g}"] = self.seconds[g]
            out[f"gc_collections_gen{g}"] = self.collections[g]
        return out


_TIMER: GcTimer | None = None


def process_gc_timer() -> GcTimer:
    """This process's GcTimer, installed into gc.callbacks on the first call (one per process,
    however many schedulers it builds, e.g. in tests)."""
    global _TIMER
    if _TIMER is None:
        _TIMER = GcTimer()
        gc.callbacks.append(_TIMER.callback)
    return _TIMER
