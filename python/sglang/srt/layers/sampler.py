"""Batched token sampler: logits processors, greedy / temperature / top-k / top-p / min-p, logprobs.

Sampling is deterministic per request: the noise of row i depends only on
(seeds[i], random_positions[i]) (see sglang.srt.sampling.random), so a request samples the same
tokens whatever batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.sampling.random import STREAM_SAMPLE, sample_from_probs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SamplerOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    # [bs] float32, log_softmax of the raw model logits at next_token_ids; None unless asked
    next_token_logprobs: torch.Tensor | None = None
    # per row (values, ids) of the top top_logprobs_nums[i] raw-logit logprobs; None unless asked
    top_logprobs: list[tuple[list[float], list[int]]] | None = None


def top_k_top_p_min_p_renorm(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """Filter and renormalise a batch of distributions.

    Args:
        probs: [bs, V] float32, rows sum to 1.
        top_ks: [bs] int64 in [1, V] (V = keep all).
        top_ps: [bs] float32 in (0, 1]: keep the smallest prefix (by descending prob) whose mass
            is >= top_p (the top token is always kept; 1.0 keeps all).
        min_ps: [bs] float32 in [0, 1]: drop probs < min_p * max prob.
    Returns:
        [bs, V] float32, rows sum to 1. Filters are all computed on the input distribution
        (as upstream's torch reference does), then combined.
    """
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # [bs, V]
    ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)  # [1, V]
    drop = ranks >= top_ks.view(-1, 1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive cumsum
    top_p = top_ps.view(-1, 1)
    drop |= (mass_before >= top_p) & (top_p < 1.0)
    drop |= sorted_probs < (sorted_probs[:, :1] * min_ps.view(-1, 1))
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def compute_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, top_nums: list[int] | None = None
) -> tuple[torch.Tensor, list[tuple[list[float], list[int]]] | None]:
    """Logprobs of `ids` under softmax(logits), and optionally the top-n per row.

    logits [bs, V] (any float dtype, computed in float32), ids [bs] int64.
    Returns (chosen [bs] float32, top) where top[i] = (values, ids) lists of length top_nums[i]
    sorted by decreasing logprob, or None when top_nums is None.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [bs, V] float32
    chosen = logprobs.gather(1, ids.view(-1, 1).long()).view(-1)  # [bs] float32
    if top_nums is None:
        return chosen, None
    k = max(top_nums + [0])
    if k == 0:
        return chosen, [([], []) for _ in top_nums]
    values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [bs, k]
    values_l, ids_l = values.tolist(), top_ids.tolist()
    top = [(values_l[i][:n], ids_l[i][:n]) for i, n in enumerate(top_nums)]
    return chosen, top


class Sampler(nn.Module):
    """Samples next tokens from [bs, V] logits with a SamplingBatchInfo (upstream's name)."""

    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SamplerOutput:
        """logits [bs, V] float32 (raw model output) -> SamplerOutput.

        Order: apply_logits_processors; greedy rows take torch.argmax of the processed logits;
        other rows: / temperature, softmax, top-k, top-p, min-p, renormalise, then the
        exponential race with counter-based noise. Logprobs are of the raw logits (the model's
        distribution), not of the processed ones.
        """
        processed = sampling_info.apply_logits_processors(logits)  # [bs, V] float32
        if sampling_info.is_all_greedy:
            next_ids = torch.argmax(processed, dim=-1)
        else:
            next_ids = self._sample(processed, sampling_info)
        out = SamplerOutput(next_token_ids=next_ids)
        if return_logprob:
            nums = top_logprobs_nums if top_logprobs_nums and any(top_logprobs_nums) else None
            out.next_token_logprobs, out.top_logprobs = compute_logprobs(logits, next_ids, nums)
        return out

    @staticmethod
    def _sample(processed: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = sampling_probs(processed, info, one_hot_greedy=False)
        sampled = sample_from_probs(probs, info.seeds, info.random_positions, STREAM_SAMPLE)
        greedy = torch.argmax(processed, dim=-1)  # [bs] int64
        return torch.where(info.greedy_mask, greedy, sampled)


def sampling_probs(
    processed: torch.Tensor, info: SamplingBatchInfo, one_hot_greedy: bool = True
) -> torch.Tensor:
    """The distribution each row samples from: softmax(processed / temperature), filtered by
    top-k / top-p / min-p and renormalised; greedy rows become one-hot at the argmax when
    one_hot_greedy (so speculative sampling treats them exactly like greedy verification).

    processed: [bs, V] float32 logits after apply_logits_processors. Returns [bs, V] float32.
    """
    probs = torch.softmax(processed / info.temperatures, dim=-1)  # [bs, V] float32
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = top_k_top_p_min_p_renorm(probs, info.top_ks, info.top_ps, info.min_ps)
    if one_hot_greedy and info.has_greedy:  # a host flag: no read-back of greedy_mask
        hot = torch.zeros_like(probs).scatter_(1, processed.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(info.greedy_mask.view(-1, 1), hot, probs)
    return probs
