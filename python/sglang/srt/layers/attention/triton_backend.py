"""Triton attention backend: our own kernels for decode and ragged causal extend.

Reads K/V through the paged req_to_token table (page size 1). Same semantics as
torch_native_backend.attention_reference: request i's queries sit at positions
[extend_prefix_lens[i], seq_lens[i]) and each attends causally to its request's keys.
On CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1, slow; tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class TritonMetadata:
    """Per-forward index tensors shared by every layer (all on the model's device)."""

    # Any integer dtype (the kernels cast on load): int32 copies when eager, the CUDA-graph
    # runner's persistent int64 buffers when captured.
    req_pool_indices: torch.Tensor  # [bs] int64, row of req_to_token per request
    seq_lens: torch.Tensor  # [bs], KV length after this step
    prefix_lens: torch.Tensor  # [bs], KV already cached before this step
    extend_lens: torch.Tensor  # [bs], queries per request this step
    extend_start: torch.Tensor  # [bs], offset of request i's first query token
    max_extend_len: int
    is_decode: bool  # every request has exactly one query


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless head_dim is a power of two in [16, 256] (kernel tile sizes)."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"--attention-backend triton needs head_dim to be a power of two in [16, 256] "
            f"(e.g. 64 or 128), got {head_dim}; use --attention-backend torch_native"
        )


class TritonAttnBackend(AttentionBackend):
    """Attention through triton_ops kernels; one kernel launch per layer, no per-request loops.

    Raises ValueError on a CPU model runner unless TRITON_INTERPRET=1 is set.
    """

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        device = getattr(model_runner, "device", None)
        if device is not None and torch.device(device).type != "cuda":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "--attention-backend triton needs a CUDA device; on CPU it runs only under "
                    "the Triton interpreter (set TRITON_INTERPRET=1, slow: for tests)"
                )

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        ext_cpu = fb.extend_seq_lens_cpu
        max_ext = max(ext_cpu) if ext_cpu else 0
        fb.attn_metadata = TritonMetadata(
            req_pool_indices=fb.req_pool_indices.to(torch.int64),
            seq_lens=fb.seq_lens.to(torch.int32),
            prefix_lens=fb.extend_prefix_lens.to(torch.int32),
            extend_lens=fb.extend_seq_lens.to(torch.int32),
            extend_start=fb.extend_start_loc.to(torch.int32),
            max_extend_len=max_ext,
            is_decode=bool(ext_cpu) and max_ext == 1 and min(ext_cpu) == 1,
        )

    # ---- CUDA graphs: the metadata points at the runner's persistent buffers, which it
    # refreshes before each replay; nothing to recompute here.
    supports_cuda_graph = True

    def init_forward_metadata_capture_cuda_graph(
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        fb = forward_batch
        fb.attn_metadata = TritonMetadata(
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            prefix_lens=fb.extend_prefix_lens,
            extend_lens=fb.extend_seq_lens,
            extend_start=fb.extend_start_loc,
            max_extend_len=max_extend_len,
            is_decode=fb.num_tokens == fb.batch_size,
        )

    def init_forward_metadata_replay_cuda_graph(
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        pass

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H * D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:  # [num_tokens, H * D] in q's dtype
        h, d = layer.tp_q_head_num, layer.head_dim
        check_head_dim(d)
        if h % layer.tp_k_head_num:
            raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads")
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, h, d)
        # zeros: rows no request owns (CUDA-graph token padding) stay finite
        out = torch.zeros_like(q)
        m: TritonMetadata = forward_batch.attn_metadata
        r2t = forward_batch.req_to_token_pool.req_to_token
        if m.is_decode:
            decode_attention_fwd(
                q, k_buf, v_buf, out, r2t, m.req_pool_indices, m.seq_lens, layer.scaling
            )
        else:
            extend_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                r2t,
                m.req_pool_indices,
                m.seq_lens,
                m.prefix_lens,
                m.extend_lens,
                m.extend_start,
                m.max_extend_len,
                layer.scaling,
            )
        return out.view(-1, h * d)
