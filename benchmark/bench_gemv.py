"""Batch-1 linear layers of the Llama-3.1-8B shape on the GPU: achieved weight-read bandwidth
of torch's bf16 `F.linear` (cuBLAS) against a Triton GEMV candidate, next to the copy
bandwidth measured in the same process.

    python benchmark/bench_gemv.py [--rows 1] [--result-file benchmark/results/gemv_h200.json]

Why: the 8B batch-1 decode step is 0.70 of the weight-read roofline and its time is the
GEMVs (issue 6). Each shape's call is captured 20 times in one CUDA graph and the graph is
replayed (launch latency excluded, as in the decode graph), cycling through copies of the
weight that together exceed the L2 cache (300 MB); GB/s = weight bytes / time. The
Triton kernel (`gemv` of python/sglang/srt/layers/triton_kernels/gemv.py, which the layers
use with SGLANG_TRITON_GEMV=1; gemv_h200.json measured its first version, then kept in this
file) is tried in a few tile configurations; the best one is reported with its maximum absolute
difference from `F.linear` (both bf16 outputs, fp32 accumulation).
Only CUDA.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from bench_common import measure_copy_bandwidth, run_meta, write_json

from sglang.srt.layers.triton_kernels.gemv import GemvTile, gemv

SHAPES = {  # name: (N out, K in) of Llama-3.1-8B
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}


def triton_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int):
    """x [M <= 2, K] bf16, w [N, K] bf16 -> [M, N] bf16, with the given tile."""
    return gemv(x, w, tile=GemvTile(block_n, block_k, warps))


def time_graph(fns: list, reps: int = 20, replays: int = 20) -> float:
    """Seconds per call, `reps` calls (cycling through fns: different weights, so that no call
    finds its weights in L2, as in the model where every layer has its own) captured in one
    CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * replays)


def bench_shape(n: int, k: int, rows: int, copy_gb_s: float, configs: list) -> dict:
    """Time F.linear and each Triton config on w [n, k], x [rows, k] (bf16)."""
    gb = n * k * 2 / 1e9
    copies = max(1, -(-300 // int(gb * 1e3)))  # >= 300 MB of weights in the rotation (L2: 50)
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
    w = ws[0]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    t_torch = time_graph([partial(torch.nn.functional.linear, x, u) for u in ws])
    ref = torch.nn.functional.linear(x, w).float()
    best = None
    tried = {}
    for bn, bk, wp in configs:
        try:
            t = time_graph([partial(triton_gemv, x, u, bn, bk, wp) for u in ws])
        except Exception as e:  # a tile that does not compile for this shape
            tried[f"{bn}x{bk}w{wp}"] = f"error {type(e).__name__}"
            continue
        tried[f"{bn}x{bk}w{wp}"] = round(gb / t, 1)
        if best is None or t < best[0]:
            best = (t, bn, bk, wp)
    row = {
        "weight_gb": gb,
        "torch_us": 1e6 * t_torch,
        "torch_gb_s": gb / t_torch,
        "torch_fraction_of_copy": gb / t_torch / copy_gb_s,
        "triton_gb_s_by_config": tried,
    }
    if best is not None:
        t, bn, bk, wp = best
        diff = (triton_gemv(x, w, bn, bk, wp).float() - ref).abs().max().item()
        row.update(
            triton_best=f"{bn}x{bk}w{wp}",
            triton_us=1e6 * t,
            triton_gb_s=gb / t,
            triton_fraction_of_copy=gb / t / copy_gb_s,
            triton_max_abs_diff=diff,
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1, help="M: batch rows (1 or 2)")
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(4 * 2**30, dev)
    out = {"meta": run_meta(), "copy_bandwidth": bw, "rows": a.rows, "shapes": {}}
    configs = [(bn, bk, wp) for bn in (4, 8, 16) for bk in (256, 512) for wp in (4, 8)]
    for name, (n, k) in SHAPES.items():
        row = bench_shape(n, k, a.rows, bw["bandwidth_gb_s"], configs)
        out["shapes"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "triton_gb_s_by_config"}))
        torch.cuda.empty_cache()
    if a.result_file:
        write_json(a.result_file, out)


if __name__ == "__main__":
    main()
