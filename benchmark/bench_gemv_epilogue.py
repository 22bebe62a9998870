"""The gate_up GEMV with SiLU-and-mul in its epilogue, per tile, against the unfused pair (the
GEMV at its default tile, then the SiLU-and-mul kernel), batch 1, bf16, on the GPU.

    python benchmark/bench_gemv_epilogue.py [--shapes llama8b smollm2] \
        [--result-file benchmark/results/gemv_epilogue_tiles_h200.json]

Why: with `epilogue_tile`'s tile (each program BLOCK_N / 2 gate rows and the matching up rows)
the 8B batch-1 decode step was 4.60 against 4.30 ms unfused (twenty-third session), and the
guess was the tile: half the bytes in flight per weight block. This times the fused kernel in
every tile of CONFIGS (block_n counts the rows of each half) next to the unfused pair, as
bench_gemv.py times a GEMV: 20 calls captured in one CUDA graph cycling through weight copies
that together exceed the L2 cache, the graph replayed; the graph has no launch gaps between
calls, so a kernel fewer per layer shows only as what the SiLU-and-mul kernel itself took.
Each fused tile is checked against the unfused result (bit for bit at the default tile's
BLOCK_K; other BLOCK_K round their sums differently: the max abs difference is reported).
Only CUDA.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from bench_common import measure_copy_bandwidth, run_meta, write_json
from bench_gemv import time_graph

from sglang.srt.layers.triton_kernels.activation import silu_and_mul
from sglang.srt.layers.triton_kernels.gemv import GemvTile, gemv, pick_tile
from sglang.srt.layers.triton_kernels.gemv_epilogue import epilogue_tile, gemv_silu_mul

SHAPES = {"llama8b": (14336, 4096), "smollm2": (1536, 576)}  # name: (intermediate I, hidden K)
# (block_n rows of each half, block_k, num_warps)
CONFIGS = [(bn, bk, wp) for bn in (4, 8, 16) for bk in (128, 256, 512) for wp in (4, 8)]


def unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(gemv(x, w))


def bench_shape(inter: int, k: int, copy_gb_s: float) -> dict:
    n = 2 * inter
    gb = n * k * 2 / 1e9
    copies = -(-300 // max(1, int(gb * 1e3)))  # >= 300 MB of weights in the rotation (L2: 50)
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    ref = unfused(x, ws[0])
    t_gemv = time_graph([partial(gemv, x, u) for u in ws])
    t_unfused = time_graph([partial(unfused, x, u) for u in ws])
    default = epilogue_tile(n, k)
    t_default = time_graph([partial(gemv_silu_mul, x, u) for u in ws])
    tile = pick_tile(n, k, 1)
    row = {
        "weight_gb": gb,
        "gemv_tile": f"{tile.block_n}x{tile.block_k}w{tile.num_warps}",
        "gemv_us": 1e6 * t_gemv,
        "unfused_us": 1e6 * t_unfused,
        "silu_and_mul_us": 1e6 * (t_unfused - t_gemv),
        "unfused_fraction_of_copy": gb / t_unfused / copy_gb_s,
        "fused_default_tile": f"{default.block_n}x{default.block_k}w{default.num_warps}",
        "fused_default_us": 1e6 * t_default,
        "fused_default_bitwise": bool(torch.equal(gemv_silu_mul(x, ws[0]), ref)),
        "fused_by_config": {},
    }
    best = None
    for bn, bk, wp in CONFIGS:
        t = GemvTile(bn, bk, wp)
        fn = partial(gemv_silu_mul, tile=t)
        try:
            us = 1e6 * time_graph([partial(fn, x, u) for u in ws])
        except Exception as e:  # a tile Triton cannot build (registers): recorded, skipped
            row["fused_by_config"][f"{bn}x{bk}w{wp}"] = {"error": repr(e)[:200]}
            continue
        diff = (fn(x, ws[0]).float() - ref.float()).abs().max().item()
        row["fused_by_config"][f"{bn}x{bk}w{wp}"] = {"us": us, "max_abs_diff": diff}
        if best is None or us < best[1]:
            best = (f"{bn}x{bk}w{wp}", us)
    if best is not None:
        row["fused_best_tile"], row["fused_best_us"] = best
        row["fused_best_speedup_vs_unfused"] = t_unfused * 1e6 / best[1]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(2 * 2**30, "cuda")
    out = {"meta": run_meta(), "copy_bandwidth": bw, "configs": CONFIGS, "results": {}}
    for name in a.shapes:
        inter, k = SHAPES[name]
        row = bench_shape(inter, k, bw["bandwidth_gb_s"])
        out["results"][name] = row
        brief = {k: v for k, v in row.items() if k != "fused_by_config"}
        print(name, json.dumps(brief))
        if a.result_file:
            write_json(a.result_file, out)


if __name__ == "__main__":
    main()
