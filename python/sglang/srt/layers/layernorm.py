"""RMSNorm with the fused residual-add form used between decoder layers."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.triton_kernels import use_triton_kernels


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), computed in float32 and
    cast back to the input dtype before the weight multiply (as HF Llama does).

    forward(x [T, H]) -> [T, H]; forward(x, residual) first sets residual = x + residual and
    returns (norm(residual), residual), the fused-add semantics of upstream's fused_add_rmsnorm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton_kernels(x, self.weight, residual):
            from sglang.srt.layers.triton_kernels.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
