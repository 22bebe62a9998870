"""torch.profiler helpers of profile_decode_step.py: the CUDA kernels of a graph's replays
(--kernel-table), a profiled window of scheduler steps (--step-profile, with its chrome trace),
and the wall ms of consecutive chunks of timed steps (step_ms_by_chunk)."""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import sync


def kernel_table(graph, device: str) -> list[str]:
    """torch.profiler's CUDA kernel table (top 40 by self time) of 8 replays of `graph`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            graph.replay()
        sync(device)
    return (
        prof.key_averages()
        .table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
        .splitlines()
    )


def step_profile(sched, a: argparse.Namespace) -> dict:
    """torch.profiler (CPU + CUDA) over a.step_profile scheduler steps: wall and summed CUDA
    kernel time per step (kernel time near the wall: the step is device-bound; far below it:
    host-bound) and the top ops by self CUDA and self CPU time."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    acts += [torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else []
    sync(a.device)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(a.step_profile):
            sched.step()
        sync(a.device)
        wall = time.perf_counter() - t0
    if a.trace_file:  # chrome://tracing / Perfetto: host launches against device kernels
        prof.export_chrome_trace(a.trace_file.removesuffix(".json") + f"_{a.mode}.json")
    ka = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA")
    n = a.step_profile
    return {
        "steps": n,
        "wall_ms_per_step_profiled": 1e3 * wall / n,
        "cuda_kernel_ms_per_step": kernel_us / 1e3 / n,
        "cuda_table": ka.table(
            sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60
        ).splitlines(),
        "cpu_table": ka.table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
        ).splitlines(),
    }


def chunk_means(t0: float, marks: list[float], chunk: int) -> list[float]:
    """Mean wall ms per step of consecutive chunks of `chunk` steps (the last may be shorter):
    shows whether the window's steps drift (warm-up, a request state that grows)."""
    out, prev = [], t0
    for i in range(0, len(marks), chunk):
        part = marks[i : i + chunk]
        out.append(round(1e3 * (part[-1] - prev) / len(part), 3))
        prev = part[-1]
    return out
