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

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027
        """Precompute per-forward metadata (index tensors, plans) once for all layers."""

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
