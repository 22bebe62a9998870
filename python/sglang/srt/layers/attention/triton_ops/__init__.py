"""Triton kernels for the triton attention backend (decode and ragged extend, page size 1)."""

from __future__ import annotations

import torch


def token_head_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """(stride(0), stride(1)) of each [tokens, heads, head_dim] tensor, flattened in order:
    the per-tensor stride arguments every kernel here takes."""
    return tuple(s for t in tensors for s in (t.stride(0), t.stride(1)))
