"""Host cost of the CUDA calls a scheduler step's launch is made of, and a calibrated GPU sleep
(both for benchmark/probe_host_waits.py, which says why they are measured). CUDA only."""

from __future__ import annotations

import time

import torch


def calibrate_sleep(device: str) -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured with events."""
    n = 2_000_000
    torch.cuda._sleep(n // 10)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / start.elapsed_time(end)


def primitives(sleep_ms: float, calls: int = 100) -> dict[str, dict[str, float]]:
    """Host microseconds per call of the CUDA primitives a decode step's launch is made of,
    with the GPU idle and with a GPU sleep of sleep_ms queued on the current stream first:
    {name: {"idle_us", "busy_us", "busy_max_us"}}. A primitive whose busy_max_us is near the
    sleep waits for the stream; one with a high idle_us is simply costly on this host."""
    dev = torch.device("cuda")
    small = torch.arange(64, dtype=torch.int64)
    pinned = small.pin_memory()
    table = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    idx = torch.arange(64, dtype=torch.int64, device=dev)
    x = torch.zeros(64, device=dev)
    ev = torch.cuda.Event()
    ev.record()
    graphs = {}
    for n in (1, 300):  # a graph of n tiny kernels (a SmolLM2 decode graph has a few hundred)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)  # warm-up outside the capture
            with torch.cuda.graph(g, stream=s):
                for _ in range(n):
                    x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        graphs[n] = g
    ops = {
        "pin_memory_64": lambda: small.pin_memory(),
        "empty_pinned_64": lambda: torch.empty(64, dtype=torch.int64, pin_memory=True),
        "h2d_pinned_nonblocking": lambda: pinned.to(dev, non_blocking=True),
        "h2d_pageable": lambda: small.to(dev),
        "tensor_from_list_cuda": lambda: torch.tensor([1, 2, 3], device=dev),
        "index_put_64": lambda: table.__setitem__(idx, 7),
        "kernel_add_": lambda: x.add_(1),
        "event_new_record": lambda: torch.cuda.Event().record(),
        "event_timing_new_record": lambda: torch.cuda.Event(enable_timing=True).record(),
        "event_query": lambda: ev.query(),
        "current_stream": lambda: torch.cuda.current_stream(),
        "graph_replay_1": lambda: graphs[1].replay(),
        "graph_replay_300": lambda: graphs[300].replay(),
    }
    cycles = int(sleep_ms * calibrate_sleep("cuda"))
    out = {}
    for name, op in ops.items():
        op()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            op()
        idle = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        out[name] = {
            "idle_us": round(1e6 * idle, 2),
            "busy_us": round(1e6 * sum(times) / calls, 2),
            "busy_max_us": round(1e6 * max(times), 2),
        }
    return out
