"""Activation functions of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.triton_kernels import use_triton_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [gate | up] input (SwiGLU, Shazeer 2020).

    forward(x [T, 2 * I]) -> [T, I], same dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_kernels(x):
            from sglang.srt.layers.triton_kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
