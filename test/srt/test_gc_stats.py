"""The scheduler process's garbage-collector counters (utils/gc_stats.py): real collections of
each generation are counted and timed, and a real scheduler reports them."""

from __future__ import annotations

import gc

from sglang.srt.utils.gc_stats import GcTimer, process_gc_timer
from sglang.test.scheduler_utils import make_scheduler


def test_counts_and_times_each_generation() -> None:
    timer = GcTimer()
    gc.callbacks.append(timer.callback)
    try:
        gc.collect(0)
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(timer.callback)
    # collections triggered by allocations in between may add to gen 0, never remove
    assert timer.collections[0] >= 2 and timer.collections[2] >= 1
    assert all(s >= 0.0 for s in timer.seconds) and timer.seconds[2] > 0.0
    gc.collect(2)  # uninstalled: no longer counted
    n2 = timer.collections[2]
    gc.collect(2)
    assert timer.collections[2] == n2
    assert set(timer.info()) == {f"gc_{k}_gen{g}" for k in ("s", "collections") for g in range(3)}


def test_reset_zeroes_the_counters() -> None:
    timer = GcTimer()
    gc.callbacks.append(timer.callback)
    try:
        gc.collect(2)
        assert timer.collections[2] >= 1
        timer.reset()
        assert timer.collections == [0, 0, 0] and timer.seconds == [0.0, 0.0, 0.0]
        gc.collect(1)  # counting goes on after a reset
        assert timer.collections[1] >= 1
    finally:
        gc.callbacks.remove(timer.callback)


def test_stop_without_start_is_ignored() -> None:
    timer = GcTimer()
    timer.callback("stop", {"generation": 1})  # installed while a collection ran
    assert timer.collections == [0, 0, 0] and timer.seconds == [0.0, 0.0, 0.0]


def test_one_timer_per_process_and_the_scheduler_reports_it(tiny_model_dir) -> None:
    assert process_gc_timer() is process_gc_timer()
    assert gc.callbacks.count(process_gc_timer().callback) == 1
    s = make_scheduler(tiny_model_dir, device="cpu", dtype="float32")
    before = s.internal_state()["gc_collections_gen2"]
    gc.collect(2)
    info = s.internal_state()
    assert info["gc_collections_gen2"] == before + 1
    assert isinstance(info["gc_s_gen2"], float) and info["gc_s_gen2"] > 0.0
    assert gc.callbacks.count(process_gc_timer().callback) == 1  # the scheduler added none
