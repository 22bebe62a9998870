"""y = x W^T (+ b) for 1 to 8 rows of x, as one Triton kernel that reads each weight tile once
(a GEMV; issue 6).

Batch-1 decode reads every weight once per step, so its linear layers are bound by memory
bandwidth. With weights cycled through 300 MB (L2-cold, as in the model) cuBLAS ``F.linear``
reached 0.64-0.90 of copy bandwidth on the Llama-3.1-8B projections on an H200, this design
0.77-0.95 (``benchmark/bench_gemv.py``, ``benchmark/results/gemv_h200.json``). A speculative
verify at batch 1 (K + 1 = 2..6 rows) and small-batch decode (3..8 rows) are just as
memory-bound: the weight is still read once per step, and the rows only multiply it.

Design, M = 1 or 2 (``_gemv_kernel``, unchanged since gemv_h200.json): one program per BLOCK_N
rows of W; it walks K in BLOCK_K tiles, loads each W tile once with ``evict_first`` (it is never
read again this step) and multiplies it by each row of x elementwise, accumulating
[BLOCK_N, BLOCK_K] partial products per row in float32; one reduction over K at the end, then
the bias (float32) is added before the single rounding to the output dtype, as ``F.linear``'s
fused bias does.

Design, M = 3..8 (``_gemv_dot_kernel``): one [BLOCK_N, BLOCK_K] accumulator per row, as above,
would take M * BLOCK_N * BLOCK_K / (32 * num_warps) float32 registers per thread: 256 at
8 rows of an 8 x 512 tile on 4 warps, past the 255 a thread has, so the accumulators would
spill. Instead each K step is one ``tl.dot`` of the W tile [BLOCK_N, BLOCK_K] (in its own
dtype, loaded once with ``evict_first``) with x's tile transposed, [BLOCK_K, BLOCK_M] with
BLOCK_M = 16 and rows >= M masked to 0, into a [BLOCK_N, BLOCK_M] float32 accumulator:
BLOCK_N * 16 / (32 * num_warps) registers per thread whatever M is (2 at the default 16 x 16
on 4 warps). This is the "swap AB" arrangement of skinny GEMMs (vLLM's SM90 block-scaled FP8
CUTLASS GEMM has a swap_ab path for small M): the weight is the MMA's wide operand and the few
rows of x its narrow one, and both are read along K as they lie in memory (W [N, K] and
x [M, K] row-major). The K loop with a float32 ``tl.dot`` accumulator is that of Triton's
matmul tutorial (``python/tutorials/03-matrix-multiplication.py``). ``tl.dot`` needs every
dimension >= 16 on GPUs, hence BLOCK_M = 16 (up to 16 rows cost the MMA the same) and BLOCK_N,
BLOCK_K powers of two >= 16. bf16/fp16 products accumulate in float32 on the tensor cores;
float32 inputs use ``input_precision="ieee"`` (no TF32). The bias is added in float32 before
the one rounding, as for M <= 2; only the summation order differs from F.linear's. M is a
runtime argument (not specialized), so one compiled variant serves every M in 3..8, e.g.
every verify bucket of a CUDA graph. On the H200 it does not beat cuBLAS at M = 3..8: its best
tile ties cuBLAS on the Llama-3.1-8B shapes (within 2.2%; o_proj 9% and lm_head 4% faster) and
the default tile below is 8-31% slower (benchmark/results/gemv_rows1-8_h200_s21.json), so the
layers send the GEMV more than one row only under SGLANG_TRITON_GEMV_MAX_ROWS
(triton_kernels/__init__.py).

Triton's CPU interpreter computes a bfloat16 ``tl.dot`` wrongly (sglang.test.triton_interpreter),
so the M > 2 kernel is checked on CPU in float32 and float16 only; bf16 on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels import GEMV_KERNEL_MAX_ROWS
from sglang.srt.layers.triton_kernels.pdl import (
    L2_LINE_BYTES,
    launch_args,
    pdl_wait,
    prefetch_cols,
    prefetch_l2,
)
from sglang.srt.layers.triton_kernels.rmsnorm import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROWS = GEMV_KERNEL_MAX_ROWS  # 8: rows of x one call takes
ELEMENTWISE_MAX_ROWS = 2  # up to here _gemv_kernel, above it _gemv_dot_kernel
DOT_BLOCK_M = 16  # x rows of one tl.dot tile (>= 16 on GPUs); rows >= M are masked


@dataclass(frozen=True)
class GemvTile:
    """Launch configuration: BLOCK_N weight rows per program, BLOCK_K columns per step."""

    block_n: int
    block_k: int
    num_warps: int


def pick_tile(n: int, k: int, m: int = 1) -> GemvTile:
    """The tile for weight [n, k] and m rows of x.

    m <= 2: the tile measured fastest at M = 1 (bf16, H200, gemv_h200.json): 16x256w4 for
    gate_up [28672, 4096] and lm_head [128256, 4096]; 4x512w8 for down [4096, 14336]; 8x512 for
    qkv [6144, 4096] (4 warps) and o_proj [4096, 4096] (8 warps).
    m > 2 (the tl.dot kernel): 16x256w4 everywhere (the smallest BLOCK_N tl.dot takes, for the
    most programs on N = 4096). Measured on the H200 it is 8-31% slower than each shape's best
    tile (64x256w4 for qkv, 32x512w4 for o_proj and down, 32x128w4 for gate_up, 64x128w4 for
    lm_head; bench_gemv.py --rows, gemv_rows1-8_h200_s21.json), which only tie cuBLAS."""
    if m > ELEMENTWISE_MAX_ROWS:
        return GemvTile(16, 256, 4)
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
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before reading x
    PF_K: tl.constexpr,  # leading weight columns prefetched into L2 before the wait (0: none)
    PF_LINE: tl.constexpr,  # elements per L2 line
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    if PF_K > 0:
        prefetch_l2(w_ptr, offs_n, N, K, PF_K, PF_LINE)
    pdl_wait(USE_PDL)
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


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K] row-major
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32); ignored for bf16/fp16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before reading x
    PF_K: tl.constexpr,  # leading weight columns prefetched into L2 before the wait (0: none)
    PF_LINE: tl.constexpr,  # elements per L2 line
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    if PF_K > 0:
        prefetch_l2(w_ptr, offs_n, N, K, PF_K, PF_LINE)
    pdl_wait(USE_PDL)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K  # [BLOCK_N, 1] pointers
    x_cols = x_ptr + offs_m[None, :] * stride_xm  # [1, BLOCK_M] pointers: x^T's columns
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # acc[n, m] = y[m, n]
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        w = tl.load(  # [BLOCK_N, BLOCK_K] in W's dtype, read once
            w_rows + kk[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        xt = tl.load(  # [BLOCK_K, BLOCK_M]: x transposed, rows >= M zero
            x_cols + kk[:, None], mask=mask_k[:, None] & mask_m[None, :], other=0.0
        )
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    y = round_to(acc, y_ptr.dtype.element_ty)
    out = y_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
    tl.store(out, y, mask=mask_n[:, None] & mask_m[None, :])


def pdl_gemv_args(weight: torch.Tensor) -> dict:
    """Launch keywords of a GEMV kernel over weight [N, K]: pdl.launch_args plus PF_K (the
    leading columns of each weight row prefetched into L2 before the PDL wait,
    pdl.prefetch_cols; 0 without PDL) and PF_LINE (elements per 128-byte line)."""
    args = launch_args(weight)
    n, k = weight.shape
    elem = weight.element_size()
    args["PF_K"] = prefetch_cols(n, k, elem, args["USE_PDL"])
    args["PF_LINE"] = max(1, L2_LINE_BYTES // elem)
    return args


def _check_dot_tile(tile: GemvTile) -> None:
    for name, size in (("block_n", tile.block_n), ("block_k", tile.block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(
                f"gemv: {name} must be a power of two >= 16 for M > {ELEMENTWISE_MAX_ROWS} "
                f"(tl.dot), got {tile}"
            )


def check_gemv_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    name: str = "gemv",
    max_rows: int = MAX_ROWS,
) -> None:
    """The argument checks of a GEMV kernel named `name` taking 1..max_rows rows of x: raises
    ValueError (the message starts with the name) for the cases gemv's docstring lists."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_rows:
        raise ValueError(f"{name}: x must be [M, K] with M in 1..{max_rows}, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{name}: weight must be [N, {x.shape[1]}] for x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"{name}: x and weight must share one of float32/float16/bfloat16, "
            f"got {x.dtype} and {weight.dtype}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"{name}: weight must be contiguous, got strides {weight.stride()}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: x must have a unit stride along K, got strides {x.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(
            f"{name}: bias must be [{weight.shape[0]}] {x.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"{name}: x, weight and bias must be on one device")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemvTile | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for M = 1..8 rows, reading the weight once.

    x: [M, K] float32/float16/bfloat16 with a unit stride along K (any row stride);
    weight: [N, K] contiguous, x's dtype; bias: None or [N] in x's dtype.
    Returns y [M, N] contiguous in x's dtype, accumulated in float32 and rounded once (the
    bias added in float32 before the rounding). M <= 2 runs the elementwise kernel, M > 2 the
    tl.dot kernel (module docstring). `tile` overrides `pick_tile(N, K, M)`.
    Raises ValueError for M outside 1..MAX_ROWS (8), mismatched shapes, dtypes or devices, a
    non-contiguous weight, x without a unit stride along K, or (M > 2) a tile whose block_n or
    block_k is not a power of two >= 16.
    """
    check_gemv_args(x, weight, bias)
    m, k = x.shape
    if m > ELEMENTWISE_MAX_ROWS:
        return _run_dot(x, weight, bias, tile)
    n = weight.shape[0]
    tile = tile or pick_tile(n, k, m)
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
        **pdl_gemv_args(weight),
    )
    return y


def gemv_dot(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemvTile | None = None,
) -> torch.Tensor:
    """The tl.dot kernel that ``gemv`` runs for M > 2, for any M in 1..8 (so that
    bench_gemv.py can time it at M = 1 and 2 too); same arguments, result and errors as
    ``gemv``. `tile` overrides `pick_tile(N, K, 3)`."""
    check_gemv_args(x, weight, bias)
    return _run_dot(x, weight, bias, tile)


def _run_dot(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: GemvTile | None
) -> torch.Tensor:
    """gemv_dot after its argument check (gemv has run the same check)."""
    m, k = x.shape
    n = weight.shape[0]
    tile = tile or pick_tile(n, k, ELEMENTWISE_MAX_ROWS + 1)
    _check_dot_tile(tile)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    grid = (triton.cdiv(n, tile.block_n),)
    _gemv_dot_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,  # not read when HAS_BIAS is false
        y,
        m,
        n,
        k,
        x.stride(0),
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=DOT_BLOCK_M,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        **pdl_gemv_args(weight),
    )
    return y
