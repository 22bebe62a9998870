"""Process helpers: children die with their parent; shutting down kills the whole tree."""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import signal
import sys

import psutil

from sglang.srt.server_args import env_flag

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
SCHEDULER_PROCESS_NAME = "sglang::sched"  # /proc/<pid>/comm of the scheduler process


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: deliver `sig` to this process when its parent dies (no-op elsewhere)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)


def set_process_name(name: str) -> None:
    """Linux: name the calling thread (the process, when called from its main thread) as `ps`,
    `top` and /proc/<pid>/comm show it; at most 15 bytes are kept (the kernel's limit). Upstream
    names its subprocesses "sglang::scheduler" and so on; benchmark/bench_server.py reads the
    name to tell the scheduler's CPU time from the HTTP process's. No-op elsewhere."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def kill_process_tree(pid: int, include_parent: bool = True, timeout_s: float = 3.0) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL whatever is left."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True)
    if include_parent:
        procs.append(parent)
    for p in procs:
        if p.pid == os.getpid():
            continue
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs([p for p in procs if p.pid != os.getpid()], timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# CPU thread pools a CUDA scheduler process should not fan out: OpenMP (torch's intra-op
# pool), OpenBLAS (numpy's, behind the adaptive step-time model) and MKL.
CPU_POOL_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def scheduler_thread_env(device: str) -> dict[str, str]:
    """Environment variables for a scheduler process on `device`: on CUDA, one thread per CPU
    pool of CPU_POOL_ENV (those the user has not set); on CPU nothing (the model runs there).

    Why: the scheduler's host work is small tensors and lists; a pool of one thread per core
    only adds wake-ups and contention. On the H200 (16 cores) the server-side time to first
    token of the Llama-3.1-8B-shaped pair with adaptive speculation was 40.9 ms with default
    pools and 23.1 ms with one thread each (24.6 ms without speculation):
    benchmark/results/ttft_8b_bs1_h200_r5.json and ttft_8b_bs1_omp1_h200_r5.json. Users who
    serve with OMP_NUM_THREADS=1 upstream do the same by hand."""
    if device != "cuda":
        return {}
    return {k: "1" for k in CPU_POOL_ENV if k not in os.environ}


# The variable that puts the scheduler's heap on huge pages (scheduler_heap_env).
HEAP_FLAG = "SCHEDULER_HUGEPAGE_HEAP"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None (musl, macOS)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, TypeError, ValueError):
        return None


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never", the bracketed
    word of `path`), or None where it cannot be read (not Linux, a sandbox)."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, ValueError):  # ValueError: bytes that are not text
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def scheduler_heap_env(thp: str | None = None) -> dict[str, str]:
    """Environment variables for a scheduler process's heap, after
    SGLANG_SCHEDULER_HUGEPAGE_HEAP (off by default):

    - `0` (default): none; Python's own allocator (pymalloc) and glibc's defaults.
    - `1`: glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES: glibc (>= 2.35) madvises its malloc
      heap for transparent huge pages, which a kernel in "madvise" mode otherwise never gives
      it. Python objects of up to 512 bytes stay in pymalloc's arenas (plain mmaps, no huge
      pages); larger ones, list and dict storage, numpy's and torch's host buffers come from
      that heap.
    - `malloc`: the same plus PYTHONMALLOC=malloc, so that every Python object comes from the
      huge-page heap (unless the user set PYTHONMALLOC: theirs wins).

    Why: at batch 1 a small model's decode is bound by the scheduler thread, whose time looks
    bound by misses more than by instructions. Measured (benchmark/README.md "thirty-second
    session"): pinned to one H200 host core, an adaptive SmolLM2 batch-1 step ran 0.656-1.201
    ms per step in six processes with pymalloc and 0.663-1.094 with `malloc`, which was faster
    in 5 of 6 back-to-back pairs (geometric mean 0.916); but on the CPU machine `malloc` made
    the scheduler's host phases at batch 128 17-25% slower (its commit 0.75-0.77 against
    0.56-0.57 ms: glibc's malloc is slower than pymalloc at small objects), while `1` was 3%
    faster there and 1-2% at batch 1 (commit_host_heap_cpu.json). Which one pays on a GPU
    host under load is not measured yet, so neither is on by default.

    Empty also where the kernel has no huge pages for it ("never", or the mode unreadable;
    `thp` overrides the mode read from /sys, thp_mode), on glibc before 2.35 or another C
    library, and when the user's GLIBC_TUNABLES already sets glibc.malloc.hugetlb (their
    choice stands; their other tunables are kept). Raises ValueError naming the variable for
    any other value."""
    mode = env_flag(HEAP_FLAG, "0").strip()
    if mode not in ("0", "1", "malloc"):
        raise ValueError(f"SGLANG_{HEAP_FLAG}={mode!r}: expected 0 (off), 1 or malloc")
    if mode == "0":
        return {}
    thp = thp_mode() if thp is None else thp
    version = glibc_version()
    if thp not in ("always", "madvise") or version is None or version < (2, 35):
        return {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    names = {item.partition("=")[0].strip() for item in tunables.split(":")}
    if "glibc.malloc.hugetlb" in names:  # the user's own choice: neither variable is set
        return {}
    joined = f"{tunables}:glibc.malloc.hugetlb=1" if tunables else "glibc.malloc.hugetlb=1"
    env = {"GLIBC_TUNABLES": joined}
    if mode == "malloc" and "PYTHONMALLOC" not in os.environ:
        env["PYTHONMALLOC"] = "malloc"
    return env


class child_env:
    """Context manager: set environment variables while a child process is spawned (the
    child inherits them at start), then restore the parent's environment."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> child_env:
        for k, v in self.env.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def apply_gil_switch_interval() -> float:
    """Experiment knob: SGLANG_GIL_SWITCH_INTERVAL_MS (a positive number) sets this process's
    sys.setswitchinterval. The scheduler thread and the overlap worker thread share the GIL,
    and on small models a decode step is GIL-bound (py-spy on the H200,
    benchmark/README.md, sixth session): how soon a waiting thread gets the GIL (Python's
    default 5 ms) may matter. Returns the interval in effect (seconds). Raises ValueError for
    a value that is not a positive number."""
    raw = env_flag("GIL_SWITCH_INTERVAL_MS").strip()
    if raw:
        try:
            ms = float(raw)
        except ValueError:
            ms = float("nan")
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(
                f"SGLANG_GIL_SWITCH_INTERVAL_MS must be a positive number, got {raw!r}"
            )
        sys.setswitchinterval(ms / 1e3)
    return sys.getswitchinterval()


def freeze_gc(context: str) -> int:
    """Collect, then move every object alive now into the garbage collector's permanent
    generation (gc.freeze), as upstream SGLang does after a process's start-up: the model,
    tokenizer and pools are never garbage, and without this each full collection walks them:
    125 ms for the 305k objects of the bundled model's scheduler on the CPU machine, a stall in
    the middle of serving, and ~0 ms after (benchmark/profile_gc_pause.py,
    benchmark/results/gc_pause_cpu.json). Returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.info("%s: froze %d start-up objects out of garbage collection", context, n)
    return n
