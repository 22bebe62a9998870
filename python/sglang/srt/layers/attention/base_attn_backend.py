"""The attention-backend interface every backend (torch_native, triton, flashinfer) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Ragged paged attention over the token-indexed KV pool (page size 1).

    For request i the step's queries are the tokens at positions
    [extend_prefix_lens[i], seq_lens[i]); keys/values are the slots
    req_to_token[req_pool_indices[i], :seq_lens[i]], causally masked.
    """

    # True when forward(save_kv_cache=True) stores K/V exactly as
    # token_to_kv_pool.set_kv_buffer(layer.layer_id, out_cache_loc, k, v) and, with
    # save_kv_cache=False, reads K/V only from the pool: then a layer may store them itself
    # (RoPE fused with the store, layers/fused_rope_kv.py) and pass save_kv_cache=False.
    saves_kv_through_pool: bool = False

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027
        """Precompute per-forward metadata (index tensors, plans) once for all layers."""

    # ---- CUDA graphs (model_executor/cuda_graph_runner.py). A graph is keyed by
    # (bs, num_tokens, max_extend_len): bs requests, num_tokens query tokens in all, at most
    # max_extend_len per request; every token is a logits row (decode or verify). The runner
    # owns static ForwardBatch tensors (views of persistent buffers, padded: pad requests have
    # extend length 1, seq length 1 and write KV slot 0) and fills them before each replay.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:  # noqa: B027
        """Allocate persistent buffers for graphs of up to max_bs requests / max_num_tokens."""

    def init_forward_metadata_capture_cuda_graph(  # noqa: B027
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        """Set forward_batch.attn_metadata before capture. Must reference only persistent
        device buffers (no host syncs, no tensors that the replay hook would not refresh)."""

    def init_forward_metadata_replay_cuda_graph(  # noqa: B027
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        """Refresh the persistent buffers before a replay. forward_batch holds the padded
        step: device tensors already filled, *_cpu lists with the padded CPU values."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Write k/v to forward_batch.out_cache_loc (if save_kv_cache) and attend."""
