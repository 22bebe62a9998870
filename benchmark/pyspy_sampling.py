"""py-spy over an in-process scheduler's decode steps (profile_decode_step.py's --py-spy-steps
and --py-spy-ttft): attach py-spy to this process, run scheduler steps while it samples, and
summarise the raw stacks per thread."""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from bench_common import sync


def py_spy_window(sched, a: argparse.Namespace) -> dict:
    """Sample every thread of this process with py-spy (attached to it, non-blocking, 1 kHz)
    while the scheduler runs --py-spy-steps more decode steps (after one second of untimed
    steps while py-spy attaches; they are sampled too); once with --gil (only the
    thread holding the GIL is sampled: where the interpreter's time goes) and once with
    --idle (where each thread is, waiting included). Raw stacks go next to --result-file;
    the JSON gets per-thread sample shares of the top leaf frames."""
    import shutil

    spy = a.py_spy_bin or shutil.which("py-spy")
    if spy is None or not os.access(spy, os.X_OK):
        return {"py_spy": f"py-spy not found ({spy})"}
    base = (a.result_file or "/tmp/decode_step.json").rsplit(".", 1)[0] + f"_{a.mode}"
    half = a.py_spy_steps // 2
    out: dict = {}
    for kind in ("gil", "idle"):
        raw = f"{base}_pyspy_{kind}.txt"
        proc = start_spy(spy, kind, raw, sched, a)
        t0 = time.perf_counter()
        for _ in range(half):
            sched.step()
        sync(a.device)
        wall = time.perf_counter() - t0
        out[f"py_spy_{kind}"] = {"step_ms": 1e3 * wall / half, "raw_file": raw}
        out[f"py_spy_{kind}"].update(stop_spy(proc, raw))
    return out


def start_spy(spy: str, kind: str, raw: str, sched, a: argparse.Namespace):
    """py-spy recording this process (--gil or --idle, every thread, raw stacks to `raw`),
    after one second of untimed scheduler steps while it attaches (they are sampled too)."""
    cmd = [spy, "record", "-p", str(os.getpid()), "--nonblocking", "-r", "1000"]
    cmd += ["--threads", "-f", "raw", "-o", raw, f"--{kind}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        sched.step()
    sync(a.device)
    return proc


def stop_spy(proc, raw: str) -> dict:
    """Stop a start_spy recording; spy_summary of what it wrote."""
    proc.send_signal(2)  # SIGINT: py-spy writes what it sampled
    log = proc.communicate(timeout=60)[0].decode(errors="replace")
    return spy_summary(raw, log)


def spy_summary(raw: str, log: str) -> dict:
    """Per thread: samples, and the 12 leaf frames (function, file:line) with most samples."""
    threads: dict[str, dict[str, int]] = {}
    try:
        with open(raw) as f:
            lines = f.read().splitlines()
    except OSError:
        return {"error": log[-2000:]}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        leaves = threads.setdefault(frames[0], {})
        leaves[frames[-1]] = leaves.get(frames[-1], 0) + int(n)
    summary = {}
    for name, leaves in threads.items():
        total = sum(leaves.values())
        top = sorted(leaves.items(), key=lambda kv: -kv[1])[:12]
        summary[name] = {"samples": total, "top_leaves": [f"{n} {k}" for k, n in top]}
    return {"threads": summary, "log_tail": log[-400:]}
