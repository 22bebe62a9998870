"""benchmark/cprofile_diff.py: per-step differences of two cProfile tables."""

from __future__ import annotations

import cProfile
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from cprofile_diff import diff_rows, load, total_us  # noqa: E402


def _work(n: int) -> int:
    object.__new__(object)  # a builtin whose pstats key carries its address ("at 0x...")
    return sum(range(n))


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _profile(path: Path, work_calls: int, busy_s: float, steps: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        for _ in range(work_calls):
            _work(10)
        _busy(busy_s)
    prof.disable()
    prof.dump_stats(str(path))


def test_diff_counts_calls_and_ranks_the_grown_function_first(tmp_path):
    steps = 20
    _profile(tmp_path / "base.prof", work_calls=1, busy_s=0.0, steps=steps)
    _profile(tmp_path / "other.prof", work_calls=3, busy_s=0.002, steps=steps)
    base, other = load(str(tmp_path / "base.prof")), load(str(tmp_path / "other.prof"))
    rows = {r["function"].rsplit("(", 1)[1]: r for r in diff_rows(base, other, steps)}
    assert rows["_work)"]["calls"] == (1.0, 3.0)  # exact call counts per step
    assert rows["_busy)"]["calls"] == (1.0, 1.0)
    # 2 ms of spinning per step lands in _busy's own time (and perf_counter's): it grew most
    top = diff_rows(base, other, steps)[0]["function"]
    assert "_busy" in top or "perf_counter" in top
    assert rows["_busy)"]["cumtime_us"][1] >= 2000.0
    # the other table's steps hold the 2 ms of spinning; the base's own per-step total (tens
    # of us under the profiler, more on a loaded machine) is no part of it
    assert total_us(other, steps) >= 2000.0
    assert total_us(other, steps) - total_us(base, steps) >= 1500.0
    with pytest.raises(ValueError, match="steps"):
        diff_rows(base, other, 0)


def test_builtins_are_matched_without_their_address(tmp_path):
    import pstats

    steps = 5
    _profile(tmp_path / "a.prof", 1, 0.0, steps)
    raw = [name for (_, _, name) in pstats.Stats(str(tmp_path / "a.prof")).stats]
    assert any(" at 0x" in name for name in raw)  # the case this is about
    keys = load(str(tmp_path / "a.prof"))
    assert not any(" at 0x" in k for k in keys)
    assert any("__new__ of type object>" in k for k in keys)
