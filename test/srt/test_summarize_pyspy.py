"""benchmark/summarize_pyspy.py on a hand-written raw py-spy file: the scheduler thread is found
by its anchor, and samples inside Triton's JIT compiler are attributed to the function that
launched the kernel."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))

from summarize_pyspy import summarize  # noqa: E402

SCHED = 'process 1:"python -m sglang.launch_server";thread (7): MainThread'
STEP = "Scheduler.step_overlap (sglang/srt/managers/scheduler.py:248)"
FILL = "fill_kv_indices (sglang/srt/layers/attention/paged_layout.py:111)"
LAUNCH = "KernelInterface.__getitem__.<locals>.<lambda> (triton/runtime/jit.py:370)"
RUN = "JITFunction.run (triton/runtime/jit.py:720)"
COMPILE = "JITFunction._do_compile (triton/runtime/jit.py:849)"
RMS = "rmsnorm (sglang/srt/layers/triton_kernels/rmsnorm.py:103)"


def test_triton_compile_samples_by_launching_function(tmp_path):
    lines = [
        f"{SCHED};{STEP};{FILL};{LAUNCH};{RUN};{COMPILE};compile (triton/compiler.py:324) 30",
        f"{SCHED};{STEP};{FILL};{LAUNCH};{RUN} 5",  # a launch of a compiled kernel
        f"{SCHED};{STEP};{RMS};{LAUNCH};{RUN};{COMPILE} 4",
        f"{SCHED};{STEP} 11",
        'process 1:"x";thread (8): other;poll (zmq.py:1) 50',  # not the scheduler thread
    ]
    path = tmp_path / "raw.txt"
    path.write_text("\n".join(lines) + "\n")
    s = summarize(str(path), "Scheduler.step_overlap", [], depth=2, min_samples=1)
    assert s["busy_samples"] == 50 and s["samples"] == 50
    assert s["triton_compiles"] == {
        "fill_kv_indices@paged_layout.py:111": 30,
        "rmsnorm@rmsnorm.py:103": 4,
    }
