"""Vocabulary-parallel embedding and LM head (upstream names: VocabParallelEmbedding,
ParallelLMHead). Rank r holds vocabulary rows [r * V/tp, (r+1) * V/tp), the vocabulary padded
up to a multiple of tp_size; padded rows are zero and are never returned as logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.linear import get_tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary.

    weight: [num_embeddings_per_partition, embedding_dim]; forward(input_ids [T] int64) ->
    [T, embedding_dim] (ids outside this rank's range contribute zeros, then an all-reduce).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        rank, size = get_tp_rank_and_size()
        self.tp_rank = rank if tp_rank is None else tp_rank
        self.tp_size = size if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings
        )
        self.prefix = prefix
        shape = (self.num_embeddings_per_partition, embedding_dim)
        self.weight = nn.Parameter(torch.zeros(shape, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full [num_embeddings, embedding_dim] tensor."""
        if loaded_weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{self.prefix or 'embedding'}: checkpoint shape {tuple(loaded_weight.shape)}, "
                f"expected {(self.num_embeddings, self.embedding_dim)}"
            )
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        torch.distributed.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing the embedding layout; used through LogitsProcessor, which
    multiplies by `weight` (and `bias` if any) and gathers the vocabulary shards."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, **kw) -> None:
        super().__init__(num_embeddings, embedding_dim, **kw)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                requires_grad=False,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
