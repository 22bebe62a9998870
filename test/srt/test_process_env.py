"""Process-level settings of a scheduler process (utils/process.py): CPU thread pools, GIL switch
interval."""

import os
import subprocess
import sys

import pytest

from sglang.srt.utils.process import (
    CPU_POOL_ENV,
    child_env,
    glibc_version,
    scheduler_heap_env,
    scheduler_thread_env,
    thp_mode,
)


def test_cuda_scheduler_gets_one_thread_per_pool_unless_the_user_set_one(monkeypatch):
    for k in CPU_POOL_ENV:
        monkeypatch.delenv(k, raising=False)
    assert scheduler_thread_env("cuda") == {k: "1" for k in CPU_POOL_ENV}
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    env = scheduler_thread_env("cuda")
    assert "OMP_NUM_THREADS" not in env
    assert env == {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_cpu_scheduler_keeps_its_thread_pools(monkeypatch):
    for k in CPU_POOL_ENV:
        monkeypatch.delenv(k, raising=False)
    assert scheduler_thread_env("cpu") == {}


def _no_heap_env(monkeypatch):
    for k in ("PYTHONMALLOC", "GLIBC_TUNABLES", "SGLANG_SCHEDULER_HUGEPAGE_HEAP"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("sglang.srt.utils.process.glibc_version", lambda: (2, 36))


def test_scheduler_heap_is_pymalloc_unless_asked_and_able(monkeypatch):
    _no_heap_env(monkeypatch)
    assert scheduler_heap_env(thp="madvise") == {}  # off by default
    monkeypatch.setenv("SGLANG_SCHEDULER_HUGEPAGE_HEAP", "1")
    tunable = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert scheduler_heap_env(thp="madvise") == tunable
    assert scheduler_heap_env(thp="always") == tunable
    monkeypatch.setenv("SGLANG_SCHEDULER_HUGEPAGE_HEAP", "malloc")
    assert scheduler_heap_env(thp="madvise") == {**tunable, "PYTHONMALLOC": "malloc"}
    monkeypatch.setenv("PYTHONMALLOC", "pymalloc")  # the user's allocator wins
    assert scheduler_heap_env(thp="madvise") == tunable
    monkeypatch.delenv("PYTHONMALLOC")
    for thp in ("never", None):  # no huge pages, or the mode unreadable
        monkeypatch.setattr("sglang.srt.utils.process.thp_mode", lambda t=thp: t)
        assert scheduler_heap_env() == {}
    # the user's other tunables are kept; their own hugetlb setting stands, alone
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert scheduler_heap_env(thp="madvise")["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    for theirs in ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2: glibc.malloc.hugetlb=1"):
        monkeypatch.setenv("GLIBC_TUNABLES", theirs)
        assert scheduler_heap_env(thp="madvise") == {}
    # a name that only contains it is another tunable
    monkeypatch.setenv("GLIBC_TUNABLES", "x.glibc.malloc.hugetlbx=7")
    assert scheduler_heap_env(thp="madvise")["GLIBC_TUNABLES"] == (
        "x.glibc.malloc.hugetlbx=7:glibc.malloc.hugetlb=1"
    )
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setattr("sglang.srt.utils.process.glibc_version", lambda: (2, 31))
    assert scheduler_heap_env(thp="madvise") == {}  # no hugetlb tunable before 2.35
    monkeypatch.setattr("sglang.srt.utils.process.glibc_version", lambda: None)
    assert scheduler_heap_env(thp="madvise") == {}  # musl, macOS
    for bad in ("yes", "2", "on"):
        monkeypatch.setenv("SGLANG_SCHEDULER_HUGEPAGE_HEAP", bad)
        with pytest.raises(ValueError, match="SGLANG_SCHEDULER_HUGEPAGE_HEAP"):
            scheduler_heap_env(thp="madvise")


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(str(f)) == "always"
    assert thp_mode(str(tmp_path / "missing")) is None
    f.write_bytes(b"\xff\xfe[always]")  # not text: no mode, rather than a failed start
    assert thp_mode(str(f)) is None


HEAP_PROBE = """
import re
x = [[i] * 200 for i in range(100_000)]  # ~160 MiB of lists: 1.6 KiB of storage each
y = [[i] for i in range(1_000_000)]  # ~100 MiB of small Python objects
text = open("/proc/self/smaps_rollup").read()
print(int(re.search(r"AnonHugePages:\\s+(\\d+) kB", text).group(1)))
"""


@pytest.mark.skipif(
    thp_mode() != "madvise" or (glibc_version() or (0, 0)) < (2, 35),
    reason="needs transparent huge pages on request (madvise) and glibc >= 2.35",
)
def test_heap_env_puts_a_childs_heap_on_huge_pages(monkeypatch):
    """The heap settings do what they are for, in a child that fills its heap with lists
    (storage from malloc) and small objects (pymalloc's unless PYTHONMALLOC=malloc): no huge
    pages without them (pymalloc and glibc never ask a "madvise" kernel), some with `1`, more
    with `malloc`."""
    _no_heap_env(monkeypatch)
    monkeypatch.setattr("sglang.srt.utils.process.glibc_version", glibc_version)

    def huge_kib(setting: str) -> int:
        monkeypatch.setenv("SGLANG_SCHEDULER_HUGEPAGE_HEAP", setting)
        with child_env(scheduler_heap_env()):
            cmd = [sys.executable, "-c", HEAP_PROBE]
            out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    off, tunable, malloc = huge_kib("0"), huge_kib("1"), huge_kib("malloc")
    assert off == 0
    assert tunable >= 32 * 1024  # at least 16 huge pages of the ~160 MiB of list storage
    assert malloc >= tunable + 32 * 1024  # and the small objects too


def test_child_env_reaches_the_child_and_the_parent_is_restored(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    code = "import os, torch; print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())"
    with child_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["1", "1"], out.stderr
    assert "OMP_NUM_THREADS" not in os.environ
    assert os.environ["MKL_NUM_THREADS"] == "3"


def test_gil_switch_interval_knob(monkeypatch):
    """SGLANG_GIL_SWITCH_INTERVAL_MS sets sys.setswitchinterval in milliseconds; unset keeps
    Python's; anything but a positive finite number is a ValueError naming the variable."""
    import sys

    from sglang.srt.utils.process import apply_gil_switch_interval

    saved = sys.getswitchinterval()
    try:
        monkeypatch.delenv("SGLANG_GIL_SWITCH_INTERVAL_MS", raising=False)
        assert apply_gil_switch_interval() == saved
        monkeypatch.setenv("SGLANG_GIL_SWITCH_INTERVAL_MS", "0.5")
        assert apply_gil_switch_interval() == pytest.approx(0.0005)
        for bad in ("0", "-1", "nan", "inf", "fast"):
            monkeypatch.setenv("SGLANG_GIL_SWITCH_INTERVAL_MS", bad)
            with pytest.raises(ValueError, match="SGLANG_GIL_SWITCH_INTERVAL_MS"):
                apply_gil_switch_interval()
    finally:
        sys.setswitchinterval(saved)


def test_bad_gil_switch_interval_fails_engine_start_naming_it(monkeypatch, tiny_model_dir):
    """The scheduler process reports the bad value like any start-up error (before, it died
    before reporting: "scheduler exited with code None")."""
    from sglang.srt.entrypoints.engine import Engine

    monkeypatch.setenv("SGLANG_GIL_SWITCH_INTERVAL_MS", "fast")
    with pytest.raises(RuntimeError, match="SGLANG_GIL_SWITCH_INTERVAL_MS must be a positive"):
        Engine(model_path=tiny_model_dir, device="cpu")


def test_freeze_gc_moves_live_objects_out_of_collection():
    """freeze_gc: garbage made before the call is collected first, and objects alive then land
    in the permanent generation (collections no longer walk them)."""
    import gc
    import weakref

    from sglang.srt.utils.process import freeze_gc

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # garbage that only a collection frees
    dead = weakref.ref(cycle)
    del cycle
    kept = Node()
    before = gc.get_freeze_count()
    try:
        n = freeze_gc("test")
        assert dead() is None
        assert n == gc.get_freeze_count() > before
        assert not any(o is kept for o in gc.get_objects())  # generations 0-2 only
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_bad_heap_setting_fails_engine_start_naming_it(monkeypatch, tiny_model_dir):
    from sglang.srt.entrypoints.engine import Engine

    monkeypatch.setenv("SGLANG_SCHEDULER_HUGEPAGE_HEAP", "yes")
    with pytest.raises(ValueError, match="SGLANG_SCHEDULER_HUGEPAGE_HEAP='yes'"):
        Engine(model_path=tiny_model_dir, device="cpu")
