"""RadixAttention: the model-side attention layer; the math lives in the attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglang.srt.layers.attention.triton_ops.decode_grouped import DecodeRope
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    """Attention over the paged KV pool for one layer (upstream name and role).

    Args: num_heads / num_kv_heads are per tensor-parallel rank; head_dim in elements;
    scaling is the softmax scale (usually head_dim ** -0.5); layer_id indexes the KV pool.
    """

    def __init__(
        self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int
    ) -> None:
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        rope: DecodeRope | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Attend (and store k, v unless save_kv_cache is False). rope: q and k are unrotated
        and the backend's decode kernel does the RoPE and the KV store (fused_rope_kv
        .decode_rope; only backends with ``fuses_decode_rope``)."""
        k = k.view(-1, self.tp_k_head_num, self.head_dim)
        v = v.view(-1, self.tp_v_head_num, self.head_dim)
        backend = forward_batch.attn_backend
        if rope is not None:  # only backends with fuses_decode_rope take it
            return backend.forward(q, k, v, self, forward_batch, save_kv_cache, rope=rope)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)
