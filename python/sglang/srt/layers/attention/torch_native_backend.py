"""Reference attention backend in plain PyTorch; runs on CPU and CUDA.

Batched path: the step's queries and each request's KV are gathered into padded
[bs, max_q] / [bs, max_kv] tensors and one scaled_dot_product_attention call runs with a mask
that is causal (offset by each request's cached prefix) and hides padding. When the padded
problem would be too large (very uneven lengths), each request gets its own SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# Largest bs * max_q * max_kv handled by the padded path (per head; scores are float32).
MAX_PADDED_SCORES = 1 << 24


def attention_reference(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [kv_len, Hkv, D]
    v: torch.Tensor,  # [kv_len, Hkv, D]
    scaling: float,
    causal_offset: int,  # query j attends to keys [0, causal_offset + j]
) -> torch.Tensor:  # [q_len, H, D]
    """Causal GQA attention for one request (the definition the other paths are tested
    against)."""
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


@dataclass
class PaddedMetadata:
    kv_slots: torch.Tensor  # [bs, max_kv] int64, KV slot per (request, position); 0 = padding
    q_rows: torch.Tensor  # [num_tokens] int64, row of each token in the [bs * max_q] layout
    mask: torch.Tensor  # [bs, 1, max_q, max_kv] bool, True = attend
    bs: int
    max_q: int


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        bs = fb.batch_size
        max_q, max_kv = max(fb.extend_seq_lens_cpu), max(fb.seq_lens_cpu)
        rows = fb.req_to_token_pool.req_to_token
        if bs * max_q * max_kv > MAX_PADDED_SCORES:
            idx = fb.req_pool_indices.tolist()
            fb.attn_metadata = [
                rows[r, :n].long() for r, n in zip(idx, fb.seq_lens_cpu, strict=True)
            ]
            return
        dev = fb.input_ids.device
        j = torch.arange(max_kv, device=dev)
        kv_valid = j[None, :] < fb.seq_lens[:, None]  # [bs, max_kv]
        kv_slots = rows[fb.req_pool_indices, :max_kv].long().masked_fill(~kv_valid, 0)
        qpos = torch.arange(max_q, device=dev)
        q_valid = qpos[None, :] < fb.extend_seq_lens[:, None]  # [bs, max_q]
        q_rows = (torch.arange(bs, device=dev)[:, None] * max_q + qpos[None, :])[q_valid]
        causal = j[None, None, :] <= (fb.extend_prefix_lens[:, None, None] + qpos[None, :, None])
        mask = (causal & kv_valid[:, None, :]).unsqueeze(1)
        fb.attn_metadata = PaddedMetadata(kv_slots, q_rows, mask, bs, max_q)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        meta = forward_batch.attn_metadata
        if isinstance(meta, PaddedMetadata):
            out = self._padded(q, k_buf, v_buf, layer, meta)
        else:
            out = self._per_request(q, k_buf, v_buf, layer, forward_batch)
        return out.reshape(-1, layer.tp_q_head_num * layer.head_dim)

    @staticmethod
    def _padded(q, k_buf, v_buf, layer: RadixAttention, m: PaddedMetadata) -> torch.Tensor:
        h, d = layer.tp_q_head_num, layer.head_dim
        n = m.q_rows.numel()  # token rows past the last request's (graph padding) stay zero
        qp = q.new_zeros(m.bs * m.max_q, h, d)
        qp[m.q_rows] = q[:n]
        qp = qp.view(m.bs, m.max_q, h, d).transpose(1, 2)  # [bs, H, max_q, D]
        kp = k_buf[m.kv_slots].transpose(1, 2)  # [bs, Hkv, max_kv, D]
        vp = v_buf[m.kv_slots].transpose(1, 2)
        group = h // kp.shape[1]
        if group > 1:
            kp = kp.repeat_interleave(group, dim=1)
            vp = vp.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            qp, kp.to(q.dtype), vp.to(q.dtype), attn_mask=m.mask, scale=layer.scaling
        )  # [bs, H, max_q, D]
        out = out.transpose(1, 2).reshape(m.bs * m.max_q, h, d)[m.q_rows]
        return out if n == q.shape[0] else torch.cat([out, q.new_zeros(q.shape[0] - n, h, d)])

    @staticmethod
    def _per_request(q, k_buf, v_buf, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        out = torch.zeros_like(q)
        start = 0
        for i, slots in enumerate(fb.attn_metadata):
            n = fb.extend_seq_lens_cpu[i]
            if n == 0:
                continue
            out[start : start + n] = attention_reference(
                q[start : start + n],
                k_buf[slots],
                v_buf[slots],
                layer.scaling,
                fb.extend_prefix_lens_cpu[i],
            ).to(q.dtype)
            start += n
        return out
