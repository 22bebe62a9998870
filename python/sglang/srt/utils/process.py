"""Process helpers: children die with their parent; shutting down kills the whole tree."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: deliver `sig` to this process when its parent dies (no-op elsewhere)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)


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
