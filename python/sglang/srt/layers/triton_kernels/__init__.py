"""Fused Triton kernels for the CUDA path (RMSNorm with residual add, SiLU-and-mul, RoPE).

The layers in ``sglang.srt.layers`` call these only when ``use_triton_kernels(tensor)`` is true:
the tensor is on CUDA, triton is importable and SGLANG_DISABLE_TRITON_KERNELS is not set.
Otherwise the plain PyTorch code runs (the CPU path, which is also the tests' reference).
The kernel modules import triton, so they are imported lazily, never on a CPU-only run.
"""

from __future__ import annotations

import importlib.util

import torch

from sglang.srt.server_args import env_flag


def _triton_enabled() -> bool:
    if env_flag("DISABLE_TRITON_KERNELS").strip().lower() in ("1", "true", "yes", "on"):
        return False
    return importlib.util.find_spec("triton") is not None


# Decided once at import: triton is installed and SGLANG_DISABLE_TRITON_KERNELS is not set.
TRITON_KERNELS_ENABLED: bool = _triton_enabled()


def use_triton_kernels(tensor: torch.Tensor) -> bool:
    """True when the fused Triton kernels should handle this tensor (CUDA and enabled)."""
    return TRITON_KERNELS_ENABLED and tensor.is_cuda
