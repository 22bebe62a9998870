"""Reference attention backend in plain PyTorch; runs on CPU and CUDA.

Each request is one scaled_dot_product_attention call over its gathered KV, with a causal
mask offset by the cached prefix (query j of request i sits at position prefix_i + j).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def attention_reference(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [kv_len, Hkv, D]
    v: torch.Tensor,  # [kv_len, Hkv, D]
    scaling: float,
    causal_offset: int,  # query j attends to keys [0, causal_offset + j]
) -> torch.Tensor:  # [q_len, H, D]
    """Causal GQA attention for one request, in float32 accumulation via SDPA."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qi = torch.arange(q_len, device=q.device).unsqueeze(1) + causal_offset
    kj = torch.arange(kv_len, device=q.device).unsqueeze(0)
    mask = kj <= qi  # [q_len, kv_len] bool, True = attend
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scaling
    )
    return out.transpose(0, 1)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        # Gather each request's KV slot list once per forward, reused by every layer.
        rows = forward_batch.req_to_token_pool.req_to_token
        idx = forward_batch.req_pool_indices.tolist()
        forward_batch.attn_metadata = [
            rows[r, :n].long() for r, n in zip(idx, forward_batch.seq_lens_cpu, strict=True)
        ]

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        out = torch.empty_like(q)
        start = 0
        for i, slots in enumerate(forward_batch.attn_metadata):
            n = forward_batch.extend_seq_lens_cpu[i]
            if n == 0:
                continue
            out[start : start + n] = attention_reference(
                q[start : start + n],
                k_buf[slots],
                v_buf[slots],
                layer.scaling,
                forward_batch.extend_prefix_lens_cpu[i],
            ).to(q.dtype)
            start += n
        return out.view(-1, layer.tp_q_head_num * layer.head_dim)
