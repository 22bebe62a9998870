"""y = x W^T (+ b) for one or two rows of x, as one Triton kernel (a GEMV; issue 6).

Batch-1 decode reads every weight once per step, so its linear layers are bound by memory
bandwidth. With weights cycled through 300 MB (L2-cold, as in the model) cuBLAS ``F.linear``
reached 0.64-0.90 of copy bandwidth on the Llama-3.1-8B projections on an H200, this design
0.77-0.95 (``benchmark/bench_gemv.py``, ``benchmark/results/gemv_h200.json``).

Design: one program per BLOCK_N rows of W; it walks K in BLOCK_K tiles, loads each W tile once
with ``evict_first`` (it is never read again this step) and multiplies it by both rows of x,
accumulating [BLOCK_N, BLOCK_K] partial products in float32; one reduction over K at the end,
then the bias (float32) is added before the single rounding to the output dtype, as
``F.linear``'s fused bias does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.rmsnorm import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROWS = 2


@dataclass(frozen=True)
class GemvTile:
    """Launch configuration: BLOCK_N weight rows per program, BLOCK_K columns per step."""

    block_n: int
    block_k: int
    num_warps: int


def pick_tile(n: int, k: int) -> GemvTile:
    """The tile measured fastest for weight [n, k] (bf16, M = 1, H200, gemv_h200.json):
    16x256w4 for gate_up [28672, 4096] and lm_head [128256, 4096]; 4x512w8 for down
    [4096, 14336]; 8x512 for qkv [6144, 4096] (4 warps) and o_proj [4096, 4096] (8 warps)."""
    if n >= 16384:
        return GemvTile(16, 256, 4)
    if k >= 8192:
        return GemvTile(4, 512, 8)
    return GemvTile(8, 512, 8 if n <= 4096 else 4)


@triton.jit
def weight_tile(w_rows, kk, mask_n, mask_k):
    """The [BLOCK_N, BLOCK_K] weight tile at columns kk of the rows w_rows ([BLOCK_N, 1]
    pointers) as float32, loaded with evict_first (a GEMV reads each weight once per step);
    masked entries are 0. Shared by every GEMV kernel (gemv_prologue.py too)."""
    return tl.load(
        w_rows + kk[None, :],
        mask=mask_n[:, None] & mask_k[None, :],
        other=0.0,
        eviction_policy="evict_first",
    ).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K] row-major
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N] contiguous
    N,
    K,
    stride_xm,
    M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    # int64 row offsets: N * K may exceed 2^31 (a large vocabulary's lm_head).
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K  # [BLOCK_N, 1] pointers
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        w = weight_tile(w_rows, kk, mask_n, mask_k)
        x0 = tl.load(x_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + kk, mask=mask_k, other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
    b = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y0 = tl.sum(acc0, axis=1)  # [BLOCK_N] float32
    if HAS_BIAS:
        y0 += b
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, round_to(y0, out_ty), mask=mask_n)
    if M > 1:
        y1 = tl.sum(acc1, axis=1)
        if HAS_BIAS:
            y1 += b
        tl.store(y_ptr + N + offs_n, round_to(y1, out_ty), mask=mask_n)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv: x must be [M, K] with M in 1..{MAX_ROWS}, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"gemv: weight must be [N, {x.shape[1]}] for x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"gemv: x and weight must share one of float32/float16/bfloat16, "
            f"got {x.dtype} and {weight.dtype}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"gemv: weight must be contiguous, got strides {weight.stride()}")
    if x.stride(1) != 1:
        raise ValueError(f"gemv: x must have a unit stride along K, got strides {x.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(
            f"gemv: bias must be [{weight.shape[0]}] {x.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("gemv: x, weight and bias must be on one device")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemvTile | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for M = 1 or 2 rows, reading the weight once.

    x: [M, K] float32/float16/bfloat16 with a unit stride along K (any row stride);
    weight: [N, K] contiguous, x's dtype; bias: None or [N] in x's dtype.
    Returns y [M, N] contiguous in x's dtype, accumulated in float32 and rounded once (the
    bias added in float32 before the rounding). `tile` overrides `pick_tile(N, K)`.
    Raises ValueError for M outside 1..2, mismatched shapes, dtypes or devices, a
    non-contiguous weight, or x without a unit stride along K.
    """
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    tile = tile or pick_tile(n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    grid = (triton.cdiv(n, tile.block_n),)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,  # not read when HAS_BIAS is false
        y,
        n,
        k,
        x.stride(0),
        M=m,
        HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
    )
    return y
