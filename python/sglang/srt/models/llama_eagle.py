"""EAGLE (EAGLE-1/2) draft head for Llama-family targets (Li et al. 2024, arXiv 2401.15077).

Architecture (SafeAILab/EAGLE eagle/model/cnets.py; upstream SGLang models/llama_eagle.py):

    x = fc(cat([embed(x_{t+1}), h_t], -1))          # fc: [H, 2H] weight (+ [H] bias)
    for layer i in 0..N-1: Llama decoder layer     # layer 0 has NO input_layernorm
    out = x (+ residual stream)                    # NO final norm
    logits = lm_head(out)                          # the target's lm_head

h_t is the target's final hidden state (after its final norm: what the target's
LogitsProcessor receives) at position t, or for later draft steps the draft's own `out` of the
previous step. The row at position t carries token x_{t+1}; its logits predict x_{t+2}.

Checkpoint names (EAGLE repo / upstream, no "model." prefix; a prefix is accepted too):
fc.weight, fc.bias, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.post_attention_layernorm.weight,
layers.{i}.input_layernorm.weight (i >= 1 only), optionally embed_tokens.weight / lm_head.weight
(ignored: like upstream, the target's embedding and lm_head are always used).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import StackedParamLoader
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class EagleDraftOutput:
    logits: torch.Tensor  # [R, vocab] float32, rows = forward_batch.logits_indices
    # [R, hidden] model dtype: the pre-lm_head stream at the same rows; the `hidden_states`
    # input of the next draft step.
    hidden_states: torch.Tensor


class EagleDecoderLayer(LlamaDecoderLayer):
    """Llama decoder layer; layer 0 skips its input norm (its input is fc's output)."""

    def __init__(self, config, layer_id: int, prefix: str = "") -> None:
        qkv_bias, o_bias = LlamaForCausalLM.attention_bias(config)
        super().__init__(config, layer_id, qkv_bias, o_bias, prefix)
        self.self_attn.rope_in_decode = False  # LlamaAttention: drafting steps lay out their slots
        if layer_id == 0:
            self.input_layernorm = nn.Identity()


class LlamaForCausalLMEagle(nn.Module):
    """EAGLE draft model (upstream name). Its KV pool has config.num_hidden_layers layers.

    Args:
        config: HF LlamaConfig of the draft (the target's shape, num_hidden_layers N >= 1).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        if getattr(config, "draft_vocab_size", None) is not None:
            raise ValueError("an EAGLE (v1) draft has no draft_vocab_size")
        config.draft_vocab_size = None  # full target vocabulary (what the worker reads)
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.draft_vocab_size: int = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(
            self.vocab_size, self.hidden_size, prefix="embed_tokens"
        )
        # bias zero unless the checkpoint has fc.bias (the EAGLE repo always trains one)
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=True)
        self.fc.requires_grad_(False)
        nn.init.zeros_(self.fc.bias)
        self.layers = nn.ModuleList(
            EagleDecoderLayer(config, i, prefix=f"layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.lm_head = ParallelLMHead(self.vocab_size, self.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(SimpleNamespace(vocab_size=self.vocab_size))

    # ---- target sharing -------------------------------------------------------------------

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor | None) -> None:
        """Use the target's embedding [vocab, hidden] and lm_head [vocab, hidden] (shared, not
        copied). Raises ValueError on a shape mismatch or a None head."""
        if head is None:
            raise ValueError("an EAGLE draft needs the target's lm_head")
        for name, t, own in (
            ("embedding", embed, self.embed_tokens),
            ("lm_head", head, self.lm_head),
        ):
            if tuple(t.shape) != tuple(own.weight.shape):
                raise ValueError(
                    f"target {name} has shape {tuple(t.shape)}, the draft expects "
                    f"{tuple(own.weight.shape)}"
                )
        self.embed_tokens.weight = _as_param(embed)
        self.lm_head.weight = _as_param(head)

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Identity: the draft predicts over the target's full vocabulary."""
        return draft_ids

    # ---- forward --------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        forward_batch: ForwardBatch,
        hidden_states: torch.Tensor,  # [T, hidden]: target final hidden or draft's own output
    ) -> EagleDraftOutput:
        """One draft forward over the ragged batch (writes K/V of layers 0..N-1 at
        forward_batch.out_cache_loc).

        Returns logits [R, vocab] float32 and the pre-lm_head hidden [R, hidden] at the rows
        forward_batch.logits_indices (R of them). Raises ValueError when hidden_states is not
        `hidden` wide (e.g. EAGLE-3 aux states [T, 3 * hidden]).
        """
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"EAGLE draft hidden_states width {hidden_states.shape[-1]}: expected the "
                f"target's final hidden states ({self.hidden_size} wide); is EAGLE-3 capture on?"
            )
        embeds = self.embed_tokens(input_ids)  # [T, H]
        hidden = self.fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, forward_batch, residual)
        out = hidden + residual  # [T, H], no final norm
        logits = self.logits_processor(out, self.lm_head, forward_batch).next_token_logits
        return EagleDraftOutput(logits, out[forward_batch.logits_indices])

    # ---- weights --------------------------------------------------------------------------

    _IGNORED = ("embed_tokens.", "lm_head.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (names with or without "model."); returns the names of the
        fully loaded parameters. embed_tokens / lm_head are skipped (the target's are used).
        Unknown names (e.g. layers.0.input_layernorm.weight, norm.weight) are skipped with a
        warning.

        Raises ValueError for a tensor of the wrong shape.
        """
        loader = StackedParamLoader(self)
        for raw_name, tensor in weights:
            name = raw_name.removeprefix("model.")
            if name.startswith(self._IGNORED) or "rotary_emb." in name:
                continue
            loader.load(name, tensor, reported_name=raw_name)
        loader.warn_unexpected(logger, "EAGLE draft")
        return loader.loaded

    def required_weight_names(self) -> set[str]:
        """Parameter names a checkpoint must provide (not the shared embedding and lm_head, and
        not fc.bias, which stays zero when absent)."""
        return {
            n
            for n, _ in self.named_parameters()
            if not n.startswith(("embed_tokens.", "lm_head.")) and n != "fc.bias"
        }


def _as_param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


EntryClass = [LlamaForCausalLMEagle]
