"""RMSNorm with an optional fused residual add, as one Triton kernel (one program per row).

Semantics of ``RMSNorm.forward`` in layers/layernorm.py: with a residual, first
``residual = x + residual`` (rounded to its dtype), then
``out = weight * (r32 * rsqrt(mean(r32^2) + eps)).to(r.dtype)`` with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.pdl import launch_args, pdl_wait

_MAX_BLOCK = 65536


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x -> dtype, rounding to nearest even like torch. For bfloat16 the rounding is
    done on the bits first (then the cast is exact), since Triton's CPU interpreter truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    out_ptr,
    w_ptr,
    x_stride,
    res_stride,
    res_out_stride,
    out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before the first load
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    # Cast back to the input dtype before the weight multiply, as the PyTorch path does.
    y = round_to(x32 * tl.rsqrt(variance + eps), x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., hidden] -> [N, hidden] with a unit last stride (a view when possible)."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm over the last dimension.

    x: [..., H] float32/float16/bfloat16; weight: [H]; residual: None or the shape of x.
    Returns out [..., H] in promote_types(weight, x) dtype, or (out, new_residual) where
    new_residual = x + residual in promote_types(x, residual) dtype. Inputs are not modified.
    Raises ValueError when shapes disagree or H exceeds 65536.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    block = triton.next_power_of_2(hidden)
    if block > _MAX_BLOCK:
        raise ValueError(f"hidden size {hidden} is larger than {_MAX_BLOCK}")
    x2 = _rows(x, hidden)  # [N, H]
    n_rows = x2.shape[0]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != {tuple(x.shape)}")
        res2 = _rows(residual, hidden)
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty((n_rows, hidden), dtype=res_dtype, device=x.device)
    else:
        res2 = x2
        res_dtype = x.dtype
        res_out = x2  # never written: HAS_RESIDUAL is false
    out = torch.empty(
        (n_rows, hidden), dtype=torch.promote_types(weight.dtype, res_dtype), device=x.device
    )
    if n_rows > 0:
        num_warps = min(max(block // 256, 1), 16)
        _rmsnorm_kernel[(n_rows,)](
            x2,
            res2,
            res_out,
            out,
            weight,
            x2.stride(0),
            res2.stride(0),
            res_out.stride(0),
            out.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
            **launch_args(x2),
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, res_out.view(x.shape)
