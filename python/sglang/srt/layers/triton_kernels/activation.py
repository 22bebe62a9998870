"""SiLU-and-mul (SwiGLU gate) as one Triton kernel: x [..., 2d] -> silu(x[..., :d]) * x[..., d:].

Rounding follows the PyTorch path (F.silu(gate) * up): silu is computed in fp32 and rounded
to the input dtype, then the product is computed in fp32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.pdl import launch_args, pdl_wait
from sglang.srt.layers.triton_kernels.rmsnorm import round_to

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_wait(USE_PDL)  # pdl.py: launched with PDL, wait before the first load
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = round_to(g32 / (1.0 + tl.exp(-g32)), gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension.

    x: [..., 2 * d] float32/float16/bfloat16. Returns a new [..., d] tensor of x's dtype.
    Raises ValueError when the last dimension is odd.
    """
    two_d = x.shape[-1]
    if two_d % 2 != 0:
        raise ValueError(f"last dimension {two_d} is not even")
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    out = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)  # [N, d]
    if n_rows > 0 and d > 0:
        block = min(_BLOCK, triton.next_power_of_2(d))
        grid = (n_rows, triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, **launch_args(x2)
        )
    return out.view(*x.shape[:-1], d)
