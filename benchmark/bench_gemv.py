"""Linear layers of the Llama-3.1-8B shape at 1 to 8 rows on the GPU: achieved weight-read
bandwidth of torch's bf16 `F.linear` (cuBLAS) against the Triton GEMV's two kernels, next to
the copy bandwidth measured in the same process.

    python benchmark/bench_gemv.py [--rows 1 2 3 4 5 6 7 8] [--shapes qkv_proj ...]
        [--result-file benchmark/results/gemv_rows1-8_h200.json]

Why: the 8B batch-1 decode step is bound by reading the weights, and so are a batch-1
speculative verify (K + 1 = 2..6 rows) and small-batch decode (3..8 rows); the layers send only
one row to the GEMV (SGLANG_TRITON_GEMV_MAX_ROWS, default 1) until this measures more. Each
shape's call is captured 20 times in one CUDA graph and the graph is replayed (launch latency
excluded, as in the decode graph), cycling through copies of the weight that together exceed
the L2 cache (300 MB); GB/s = weight bytes / time.

Per row count M and shape it times, all in bf16 with float32 accumulation:
- `torch`: F.linear (cuBLAS);
- `default`: `gemv` as the layers call it (its kernel for M, the tile `pick_tile(N, K, M)`);
- `elementwise` (M <= 2 only): the M <= 2 kernel in every tile of ELEMENTWISE_CONFIGS;
- `dot`: the tl.dot kernel (`gemv_dot`, which `gemv` runs for M > 2) in every tile of
  DOT_CONFIGS, at M = 1 and 2 too.
Each kernel's best tile is reported with its maximum absolute difference from F.linear.
gemv_h200.json (M = 1) and gemv_rows2_h200_s9.json (M = 2) measured earlier versions with one
row count per file. Only CUDA.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from bench_common import measure_copy_bandwidth, run_meta, write_json

from sglang.srt.layers.triton_kernels.gemv import (
    ELEMENTWISE_MAX_ROWS,
    MAX_ROWS,
    GemvTile,
    gemv,
    gemv_dot,
    pick_tile,
)

SHAPES = {  # name: (N out, K in) of Llama-3.1-8B
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}
# (block_n, block_k, num_warps)
ELEMENTWISE_CONFIGS = [(bn, bk, wp) for bn in (4, 8, 16) for bk in (256, 512) for wp in (4, 8)]
DOT_CONFIGS = [(bn, bk, wp) for bn in (16, 32, 64) for bk in (128, 256, 512) for wp in (4, 8)]


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


def _sweep(kernel, x: torch.Tensor, ws: list, configs: list, gb: float, ref: torch.Tensor):
    """Time `kernel(x, w, tile=...)` in every config; returns (GB/s by config, best summary or
    None when no config ran)."""
    tried, best = {}, None
    for bn, bk, wp in configs:
        name, tile = f"{bn}x{bk}w{wp}", GemvTile(bn, bk, wp)
        try:
            t = time_graph([partial(kernel, x, u, tile=tile) for u in ws])
        except Exception as e:  # a tile that does not compile for this shape
            tried[name] = f"error {type(e).__name__}"
            continue
        tried[name] = round(gb / t, 1)
        if best is None or t < best[0]:
            best = (t, name, tile)
    if best is None:
        return tried, None
    t, name, tile = best
    diff = (kernel(x, ws[0], tile=tile).float() - ref).abs().max().item()
    return tried, {"tile": name, "us": 1e6 * t, "gb_s": gb / t, "max_abs_diff": diff}


def bench_shape(n: int, k: int, rows: int, copy_gb_s: float) -> dict:
    """Time F.linear, gemv's default and both kernels' tiles on w [n, k], x [rows, k] (bf16)."""
    gb = n * k * 2 / 1e9
    copies = -(-300 // max(1, int(gb * 1e3)))  # >= 300 MB of weights in the rotation (L2: 50)
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    t_torch = time_graph([partial(torch.nn.functional.linear, x, u) for u in ws])
    ref = torch.nn.functional.linear(x, ws[0]).float()
    t_default = time_graph([partial(gemv, x, u) for u in ws])
    tile = pick_tile(n, k, rows)
    row = {
        "weight_gb": gb,
        "torch_us": 1e6 * t_torch,
        "torch_gb_s": gb / t_torch,
        "torch_fraction_of_copy": gb / t_torch / copy_gb_s,
        "default_tile": f"{tile.block_n}x{tile.block_k}w{tile.num_warps}",
        "default_us": 1e6 * t_default,
        "default_gb_s": gb / t_default,
        "default_max_abs_diff": (gemv(x, ws[0]).float() - ref).abs().max().item(),
        "default_speedup_vs_torch": t_torch / t_default,
    }
    kernels = {"dot": (gemv_dot, DOT_CONFIGS)}
    if rows <= ELEMENTWISE_MAX_ROWS:
        kernels["elementwise"] = (gemv, ELEMENTWISE_CONFIGS)
    for name, (kernel, configs) in kernels.items():
        tried, best = _sweep(kernel, x, ws, configs, gb, ref)
        row[f"{name}_gb_s_by_config"] = tried
        if best is not None:
            best["speedup_vs_torch"] = best["gb_s"] / row["torch_gb_s"]
            best["fraction_of_copy"] = best["gb_s"] / copy_gb_s
            row[f"{name}_best"] = best
    return row


def _summary(results: dict) -> list[str]:
    """One line per (rows, shape): us of cuBLAS, gemv's default, each kernel's best tile."""
    lines = ["rows shape          torch_us default_us  best_dot_us  best_elementwise_us"]
    for rows, shapes in results.items():
        for name, r in shapes.items():
            dot = r.get("dot_best", {}).get("us", float("nan"))
            ew = r.get("elementwise_best", {}).get("us", float("nan"))
            lines.append(
                f"{rows:>4} {name:<14} {r['torch_us']:8.1f} {r['default_us']:10.1f} "
                f"{dot:12.1f} {ew:20.1f}"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rows", type=int, nargs="+", default=[1], help=f"row counts M to time (1..{MAX_ROWS})"
    )
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    if not all(1 <= m <= MAX_ROWS for m in a.rows):
        p.error(f"--rows must be in 1..{MAX_ROWS}, got {a.rows}")
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(4 * 2**30, "cuda")
    out = {"meta": run_meta(), "copy_bandwidth": bw, "rows": a.rows, "results": {}}
    for rows in a.rows:
        out["results"][str(rows)] = shapes = {}
        for name in a.shapes:
            n, k = SHAPES[name]
            row = bench_shape(n, k, rows, bw["bandwidth_gb_s"])
            shapes[name] = row
            brief = {k: v for k, v in row.items() if not k.endswith("_by_config")}
            print(rows, name, json.dumps(brief))
            torch.cuda.empty_cache()
        if a.result_file:  # after every row count: a timed-out run keeps what it measured
            write_json(a.result_file, out)
    print("\n".join(_summary(out["results"])))


if __name__ == "__main__":
    main()
