"""The one-row GEMV of gemv.py with its input computed in the K loop (issue 6): RMSNorm (with
the residual add) before qkv_proj / gate_up_proj, SiLU-and-mul before down_proj. Each saves the
small kernel before the GEMV, its launch gap in the CUDA graph, and one round trip of the
[1, H] or [1, I] row through memory.

Rounding of the SiLU-and-mul GEMV is that of the unfused Triton path (activation.py, then
gemv.py with the same tile): silu(g) and silu(g) * u are rounded to the dtype where those kernels
round them and the products with W accumulate in float32 in the GEMV's order, so it equals the
unfused path bit for bit (tested under the interpreter). Every program recomputes the input
tiles it multiplies (a few flops per input element, per program).

The RMSNorm GEMV has two kernels (gemv_rmsnorm's `exact`):
- scaled (the layers' default, NORM_PROLOGUE_EXACT off): since 1/rms(h) is one scalar per row,
  y = (sum_k W[n, k] h_k g_k) / rms(h). The K loop accumulates W * (h * g) and sum(h^2)
  together and scales once at the end, so no program waits for a pass over the row before it
  streams weights. The normed row is not rounded to the dtype in between, so y differs from
  the unfused path by about one rounding of the output (within bf16 tolerance; not bitwise).
- exact: every program first reduces sum(h^2) over the whole row like rmsnorm.py (one
  ``tl.sum`` over next_power_of_2(H) lanes), then rounds the normed row where rmsnorm.py does;
  under Triton's interpreter the result is bit-identical to the unfused path. Compiled, the
  order of ``tl.sum`` depends on num_warps (16 for rmsnorm at H = 4096, the tile's 4 or 8 here),
  so a normed bf16 element can round one step differently. On the H200 it made the 8B-shaped
  batch-1 decode slower (4.47 -> 5.24 ms per step, fourteenth session): the pre-pass delays
  every program's weight stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels import NORM_PROLOGUE_MAX_HIDDEN
from sglang.srt.layers.triton_kernels.gemv import GemvTile, pdl_gemv_args, pick_tile, weight_tile
from sglang.srt.layers.triton_kernels.pdl import pdl_wait, prefetch_l2
from sglang.srt.layers.triton_kernels.rmsnorm import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _residual_sum(x_ptr, res_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """h = x + residual rounded to x's dtype (rmsnorm.py's rounding), or x; x's dtype."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
    return x


@triton.jit
def _gemv_rmsnorm_kernel(
    x_ptr,  # [H]
    res_ptr,  # [H] or unused
    res_out_ptr,  # [H] or unused; written by program 0
    nw_ptr,  # [H] norm weight
    w_ptr,  # [N, H] row-major
    b_ptr,  # [N] or unused
    y_ptr,  # [N]
    N,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before reading x / residual
    PF_K: tl.constexpr,  # leading weight columns prefetched into L2 before the wait (0: none)
    PF_LINE: tl.constexpr,  # elements per L2 line
):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    if PF_K > 0:
        prefetch_l2(w_ptr, pid * BLOCK_N + tl.arange(0, BLOCK_N), N, H, PF_K, PF_LINE)
    pdl_wait(USE_PDL)
    if EXACT:
        # 1/rms(h) over the whole row, reduced exactly as rmsnorm.py does (every program
        # repeats it before its K loop).
        cols = tl.arange(0, BLOCK_H)
        h32 = _residual_sum(x_ptr, res_ptr, cols, cols < H, HAS_RESIDUAL).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h32 * h32, axis=0) / H + eps)

    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * H  # [BLOCK_N, 1] pointers
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)  # scaled mode: sum of h^2 per lane
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < H
        h = _residual_sum(x_ptr, res_ptr, kk, mask_k, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(res_out_ptr + kk, h, mask=mask_k)
        nw = tl.load(nw_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        if EXACT:
            normed = round_to(h.to(tl.float32) * rstd, dtype)
            xk = round_to(normed.to(tl.float32) * nw, dtype).to(tl.float32)
        else:
            h32 = h.to(tl.float32)
            sq += h32 * h32
            xk = h32 * nw
        acc += weight_tile(w_rows, kk, mask_n, mask_k) * xk[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N] float32
    if not EXACT:
        # sum_k W[n, k] h_k g_k / rms(h): the row's scale applied once, after the K loop
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / H + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, round_to(y, dtype), mask=mask_n)


@triton.jit
def _gemv_silu_mul_kernel(
    gu_ptr,  # [2 * I]: gate then up
    w_ptr,  # [N, I] row-major
    y_ptr,  # [N]
    N,
    inter,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before reading gate_up
    PF_K: tl.constexpr,  # leading weight columns prefetched into L2 before the wait (0: none)
    PF_LINE: tl.constexpr,  # elements per L2 line
):
    pid = tl.program_id(0)
    dtype = gu_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    if PF_K > 0:
        prefetch_l2(w_ptr, offs_n, N, inter, PF_K, PF_LINE)
    pdl_wait(USE_PDL)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * inter  # [BLOCK_N, 1] pointers
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < inter
        g32 = tl.load(gu_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        u32 = tl.load(gu_ptr + inter + kk, mask=mask_k, other=0.0).to(tl.float32)
        act = round_to(g32 / (1.0 + tl.exp(-g32)), dtype)  # activation.py's two roundings
        xk = round_to(act.to(tl.float32) * u32, dtype).to(tl.float32)
        acc += weight_tile(w_rows, kk, mask_n, mask_k) * xk[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, round_to(y, dtype), mask=mask_n)


def _check_row(name: str, t: torch.Tensor, width: int, dtype: torch.dtype) -> None:
    if t.shape != (1, width) or t.dtype != dtype or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be [1, {width}] {dtype} with a unit last stride, "
            f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_weight(
    weight: torch.Tensor, k: int, dtype: torch.dtype, device: torch.device, what: str
) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"{what}: dtype must be float32/float16/bfloat16, got {dtype}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != dtype:
        raise ValueError(
            f"{what}: weight must be [N, {k}] {dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"{what}: weight must be contiguous, got strides {weight.stride()}")
    if weight.device != device:
        raise ValueError(f"{what}: every tensor must be on {device}, weight is on {weight.device}")


def gemv_rmsnorm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    tile: GemvTile | None = None,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linear(rmsnorm(x + residual))`` for one row in one kernel: with h = x + residual (or x),
    y = (h / sqrt(mean(h^2) + eps) * norm_weight) @ W^T + b.

    exact=False (the layers' default, NORM_PROLOGUE_EXACT): the K loop multiplies W by
    h * norm_weight in float32 while it sums h^2, and y is scaled by 1/rms(h) once after the
    loop, so the GEMV streams its weights from the first instruction; the normed row is never
    rounded to the dtype, so y can differ from the unfused path by about one rounding step
    of the output. exact=True: every program first reduces sum(h^2) over the whole row, then
    rounds as ``rmsnorm(x, norm_weight, eps, residual)`` then ``gemv(normed, weight, bias)``
    do (bit for bit under the interpreter).

    x: [1, H] float32/float16/bfloat16, unit last stride; residual: None or like x;
    norm_weight: [H]; weight: [N, H] contiguous; bias: None or [N]; all of x's dtype and device.
    Returns (y [1, N] contiguous in x's dtype, residual_out): residual_out is a new [1, H]
    tensor h (x + residual rounded to the dtype) when residual is given (program 0 writes it),
    else None. Inputs are not modified. `tile` overrides pick_tile(N, H), which the unfused
    gemv also uses.
    Raises ValueError for other shapes, dtypes, devices or strides, or H above
    NORM_PROLOGUE_MAX_HIDDEN (the exact kernel holds the whole row in one program).
    """
    hidden = x.shape[-1] if x.dim() == 2 else -1
    _check_row("gemv_rmsnorm: x", x, hidden, x.dtype)
    if hidden == 0 or hidden > NORM_PROLOGUE_MAX_HIDDEN:
        raise ValueError(f"gemv_rmsnorm: H must be in 1..{NORM_PROLOGUE_MAX_HIDDEN}, got {hidden}")
    _check_weight(weight, hidden, x.dtype, x.device, "gemv_rmsnorm")
    if residual is not None:
        _check_row("gemv_rmsnorm: residual", residual, hidden, x.dtype)
    if norm_weight.shape != (hidden,) or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"gemv_rmsnorm: norm_weight must be [{hidden}] {x.dtype}, "
            f"got {tuple(norm_weight.shape)} {norm_weight.dtype}"
        )
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(
            f"gemv_rmsnorm: bias must be [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    for name, t in (("residual", residual), ("norm_weight", norm_weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"gemv_rmsnorm: {name} is on {t.device}, x on {x.device}")
    tile = tile or pick_tile(n, hidden)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    if n > 0:
        _gemv_rmsnorm_kernel[(triton.cdiv(n, tile.block_n),)](
            x,
            x if residual is None else residual,  # not read without a residual
            x if res_out is None else res_out,  # not written without a residual
            norm_weight,
            weight,
            weight if bias is None else bias,  # not read without a bias
            y,
            n,
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            HAS_BIAS=bias is not None,
            EXACT=exact,
            # the exact kernel's pre-pass width; unused by the scaled kernel
            BLOCK_H=triton.next_power_of_2(hidden) if exact else 16,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            num_warps=tile.num_warps,
            **pdl_gemv_args(weight),
        )
    elif res_out is not None:
        res_out.copy_(x + residual)
    return y, res_out


def gemv_silu_mul(
    gate_up: torch.Tensor, weight: torch.Tensor, *, tile: GemvTile | None = None
) -> torch.Tensor:
    """``gemv(silu_and_mul(gate_up), weight)`` in one kernel: y = (silu(g) * u) @ W^T for
    gate_up = [g | u], rounded as activation.py then gemv.py round it (bit-identical to them).

    gate_up: [1, 2 * I] float32/float16/bfloat16, contiguous; weight: [N, I] contiguous, same
    dtype and device. Returns y [1, N] contiguous in gate_up's dtype. No bias: RowParallelLinear
    adds its bias after the GEMV. `tile` overrides pick_tile(N, I).
    Raises ValueError for other shapes, dtypes, devices or strides.
    """
    two_i = gate_up.shape[-1] if gate_up.dim() == 2 else -1
    if two_i % 2 != 0 or not gate_up.is_contiguous():
        raise ValueError(
            f"gemv_silu_mul: gate_up must be a contiguous [1, 2 * I], got "
            f"{tuple(gate_up.shape)} strides {gate_up.stride()}"
        )
    _check_row("gemv_silu_mul: gate_up", gate_up, two_i, gate_up.dtype)
    inter = two_i // 2
    _check_weight(weight, inter, gate_up.dtype, gate_up.device, "gemv_silu_mul")
    n = weight.shape[0]
    tile = tile or pick_tile(n, inter)
    y = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    if n > 0:
        _gemv_silu_mul_kernel[(triton.cdiv(n, tile.block_n),)](
            gate_up,
            weight,
            y,
            n,
            inter,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            num_warps=tile.num_warps,
            **pdl_gemv_args(weight),
        )
    return y
