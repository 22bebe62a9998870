"""The gate_up GEMV with SiLU-and-mul in its epilogue: act = silu(x W_gate^T) * (x W_up^T) for
one row x, as one kernel instead of the GEMV then ``_silu_and_mul_kernel`` (issue 6).

Why: at batch 1 every small kernel of a decoder layer costs its own launch and ramp inside the
CUDA graph; the 8B-shaped decode spent ~0.5 ms of its 4.24 ms step outside the GEMVs, in six
small kernels per layer (docs/gpu_fast_path.md, "Not done yet"). The SiLU-and-mul prologue in
the down GEMV (gemv_prologue.py) removed the same kernel but was slower on the H200 (4.78
against 4.48 ms per step, benchmark/README.md "fourteenth session"): every one of the down
GEMV's programs (4 weight rows each) re-reads and re-activates the whole [2 I] gate_up row. An
epilogue reads nothing more than the unfused GEMV: each program computes BLOCK_N rows of gate
and the same BLOCK_N rows of up (weight rows n and I + n), then writes silu(gate) * up for them.

Off by default (SGLANG_FUSED_GEMV_EPILOGUE=1 turns it on): on the H200 the Llama-3.1-8B-shaped
batch-1 decode was slower with it, 4.60 against 4.30 ms per step (ABAB, twenty-third session).
The likely cause is the tile: each program loads two blocks of BLOCK_N / 2 rows where the
unfused GEMV loads one of BLOCK_N, so each K step has half as many bytes in flight per block;
a tile of BLOCK_N rows per half (tile=) is the next thing to measure.

Rounding is the unfused path's, so the result is bit for bit that of ``gemv`` followed by
``silu_and_mul`` when both use the same BLOCK_K (each output's K loop and final reduction are
the same float32 operations whatever BLOCK_N is): gate and up are accumulated in float32, the
bias added in float32, each rounded to the output dtype; then silu in float32 rounded to the
dtype, times up in float32, rounded once more (activation.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.gemv import (
    GemvTile,
    check_gemv_args,
    pick_tile,
    weight_tile,
)
from sglang.srt.layers.triton_kernels.pdl import launch_args, pdl_wait
from sglang.srt.layers.triton_kernels.rmsnorm import round_to


@triton.jit
def _gemv_silu_mul_kernel(
    x_ptr,  # [K], one row
    w_ptr,  # [2 * I, K] row-major: gate rows 0..I-1, then up rows I..2I-1
    b_ptr,  # [2 * I] or unused
    y_ptr,  # [I]
    I,  # noqa: E741 (the intermediate size)
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before the first load
):
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < I
    rows = offs_n.to(tl.int64)
    gate_rows = w_ptr + rows[:, None] * K  # [BLOCK_N, 1] pointers
    up_rows = w_ptr + (rows + I)[:, None] * K
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        x = tl.load(x_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        acc_g += weight_tile(gate_rows, kk, mask_n, mask_k) * x
        acc_u += weight_tile(up_rows, kk, mask_n, mask_k) * x
    g = tl.sum(acc_g, axis=1)  # [BLOCK_N] float32
    u = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        g += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + I + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    g = round_to(g, out_ty).to(tl.float32)  # what the unfused GEMV writes
    u = round_to(u, out_ty).to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), out_ty).to(tl.float32)  # activation.py's rounding
    tl.store(y_ptr + offs_n, round_to(act * u, out_ty), mask=mask_n)


def epilogue_tile(n_total: int, k: int) -> GemvTile:
    """The tile for a [n_total = 2 I, K] gate_up weight: pick_tile's for the unfused GEMV of
    that weight with half its BLOCK_N (each program loads BLOCK_N gate and BLOCK_N up rows,
    the rows one unfused program loads) and the same BLOCK_K (so the sums are the same)."""
    t = pick_tile(n_total, k, 1)
    return GemvTile(max(1, t.block_n // 2), t.block_k, t.num_warps)


def gemv_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemvTile | None = None,
) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = F.linear(x, weight, bias), as one GEMV kernel.

    x: [1, K] float32/float16/bfloat16 with a unit stride along K; weight: [2 * I, K]
    contiguous in x's dtype (gate rows first, then up: MergedColumnParallelLinear's layout of
    gate_up_proj); bias: None or [2 * I] in x's dtype. Returns [1, I] in x's dtype, equal bit
    for bit to ``silu_and_mul(gemv(x, weight, bias))`` at the same BLOCK_K. `tile` overrides
    epilogue_tile(2 I, K) (block_n counts rows of each half).
    Raises ValueError for x not one row, an odd number of weight rows, mismatched shapes,
    dtypes or devices, a non-contiguous weight or x without a unit stride along K.
    """
    check_gemv_args(x, weight, bias, "gemv_silu_mul", max_rows=1)
    if weight.shape[0] % 2:
        raise ValueError(
            f"gemv_silu_mul: weight must be [2 * I, K] (gate rows, then up rows), "
            f"got {tuple(weight.shape)}"
        )
    k, inter = x.shape[1], weight.shape[0] // 2
    tile = tile or epilogue_tile(weight.shape[0], k)
    y = torch.empty((1, inter), dtype=x.dtype, device=x.device)
    if inter == 0:
        return y
    _gemv_silu_mul_kernel[(triton.cdiv(inter, tile.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # not read when HAS_BIAS is false
        y,
        inter,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        **launch_args(x),
    )
    return y
