"""Linear layers fused with the elementwise op next to them at batch 1 (issue 6): RMSNorm ->
qkv_proj / gate_up_proj and SiLU-and-mul -> down_proj as one GEMV each
(triton_kernels/gemv_prologue.py: the RMSNorm one on by default), and gate_up_proj ->
SiLU-and-mul as one GEMV (triton_kernels/gemv_epilogue.py, linear_silu_mul).

Each ``*_applies`` check says whether the fused kernel may replace the unfused pair: the GEMV
would take the unfused path's input (use_fused_gemv_prologue: one bf16/fp16 row on CUDA, the
GEMV enabled, the kind named in SGLANG_FUSED_GEMV_PROLOGUE: "norm" by default, see
triton_kernels/__init__.py), tensor-parallel size 1, the plain RMSNorm,
and a bias the GEMV adds as apply_linear does. Otherwise callers run the unfused modules.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers import triton_kernels
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.triton_kernels import (
    NORM_PROLOGUE_MAX_HIDDEN,
    use_fused_gemv_epilogue,
    use_fused_gemv_prologue,
)


def rmsnorm_linear_applies(
    norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> bool:
    """Whether rmsnorm_linear(norm, linear, x, residual) may replace ``norm`` then ``linear``:
    norm is exactly RMSNorm (not a subclass, not nn.Identity) with x's dtype, linear a
    ColumnParallelLinear at tp_size 1 that adds its own bias (of x's dtype, if any), x [1, H]
    with H <= NORM_PROLOGUE_MAX_HIDDEN, residual None or of x's shape, dtype and strides, and
    use_fused_gemv_prologue(x, linear.weight, "norm")."""
    if type(norm) is not RMSNorm or not isinstance(linear, ColumnParallelLinear):
        return False
    bias = linear.bias
    return (
        linear.tp_size == 1
        and not linear.skip_bias_add
        and (bias is None or bias.dtype == x.dtype)
        and x.dim() == 2
        and x.shape[-1] <= NORM_PROLOGUE_MAX_HIDDEN
        and norm.weight.dtype == x.dtype
        and (residual is None or _same_layout(residual, x))
        and use_fused_gemv_prologue(x, linear.weight, "norm")
    )


def rmsnorm_linear(
    norm: RMSNorm,
    linear: ColumnParallelLinear,
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(h))[0], h) for h = x + residual (or x when residual is None), as one kernel
    (gemv_rmsnorm's scaled kernel, or its exact one under SGLANG_FUSED_GEMV_NORM_EXACT=1).

    x: [1, H]; residual: None or [1, H]; call only where rmsnorm_linear_applies is true.
    Returns ([1, N] in x's dtype, h [1, H]: a new tensor, or x itself without a residual).
    Raises ValueError (from gemv_rmsnorm) for inputs it does not take.
    """
    from sglang.srt.layers.triton_kernels.gemv_prologue import gemv_rmsnorm

    y, h = gemv_rmsnorm(
        x,
        norm.weight,
        norm.variance_epsilon,
        linear.weight,
        linear.bias,
        residual,
        exact=triton_kernels.NORM_PROLOGUE_EXACT,
    )
    return y, (x if h is None else h)


def silu_mul_linear_applies(gate_up: torch.Tensor, linear: nn.Module) -> bool:
    """Whether silu_mul_linear(gate_up, linear) may replace SiluAndMul then ``linear``: linear
    a RowParallelLinear at tp_size 1, gate_up a contiguous [1, 2 * I] for its [N, I] weight, and
    use_fused_gemv_prologue(..., "silu") for the [1, I] row SiluAndMul would make."""
    if not isinstance(linear, RowParallelLinear) or linear.tp_size != 1:
        return False
    inter = linear.weight.shape[-1]
    return (
        gate_up.dim() == 2
        and gate_up.shape[-1] == 2 * inter
        and gate_up.is_contiguous()
        and use_fused_gemv_prologue(gate_up[:, :inter], linear.weight, "silu")
    )


def silu_mul_linear(gate_up: torch.Tensor, linear: RowParallelLinear) -> torch.Tensor:
    """linear(silu(gate) * up)[0] for gate_up = [gate | up] [1, 2 * I], as one kernel; the bias
    (if any) is added afterwards like RowParallelLinear.forward does. Returns [1, N] in
    gate_up's dtype. Call only where silu_mul_linear_applies is true."""
    from sglang.srt.layers.triton_kernels.gemv_prologue import gemv_silu_mul

    out = gemv_silu_mul(gate_up, linear.weight)
    if linear.bias is not None and not linear.skip_bias_add:
        out = out + linear.bias
    return out


def linear_silu_mul_applies(x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether linear_silu_mul(x, linear) may replace ``linear`` then SiluAndMul: linear a
    MergedColumnParallelLinear of two equal halves (gate_up_proj; at any tp size each rank's
    weight is [gate shard | up shard]) that adds its own bias (of x's dtype, if any), x [1, H],
    and use_fused_gemv_epilogue(x, linear.weight)."""
    if not triton_kernels.FUSED_GEMV_EPILOGUE_ENABLED:  # off by default: decided first
        return False
    if not isinstance(linear, MergedColumnParallelLinear):
        return False
    sizes, bias = linear.output_sizes, linear.bias
    return (
        len(sizes) == 2
        and sizes[0] == sizes[1]
        and not linear.skip_bias_add
        and (bias is None or bias.dtype == x.dtype)
        and x.dim() == 2
        and x.shape[0] == 1
        and use_fused_gemv_epilogue(x, linear.weight)
    )


def linear_silu_mul(x: torch.Tensor, linear: MergedColumnParallelLinear) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = linear(x)[0], as one kernel. x: [1, H]; returns
    [1, I / tp] in x's dtype. Call only where linear_silu_mul_applies is true."""
    from sglang.srt.layers.triton_kernels.gemv_epilogue import gemv_silu_mul

    return gemv_silu_mul(x, linear.weight, linear.bias)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.stride(-1) == b.stride(-1) == 1
