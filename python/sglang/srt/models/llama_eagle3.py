"""EAGLE-3 draft head for Llama-family targets (Li et al. 2025, arXiv 2503.01840).

One decoder layer whose attention input is [input_layernorm(embedding) ; hidden_norm(hidden)]
(2 * hidden wide), fed either by `fc` over the concatenation of three target hidden states
(first draft step / draft extend) or by the draft's own pre-norm hidden state of the previous
step. Checkpoint names follow upstream SGLang / SpecForge (see docs: "EAGLE-3 checkpoints"):
fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight [draft_vocab, hidden], d2t [draft_vocab] int64, t2d [vocab] bool. Names may carry
a "model." prefix. The embedding always comes from the target (set_embed_and_head).

Token/hidden pairing (upstream and SpecForge): the row at position t carries token x_{t+1} and the
hidden state computed for position t; its logits predict x_{t+2}.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import StackedParamLoader
from sglang.srt.models.llama import LlamaAttention, LlamaMLP

logger = logging.getLogger(__name__)


@dataclass
class Eagle3DraftOutput:
    logits: torch.Tensor  # [R, draft_vocab] float32, rows = forward_batch.logits_indices
    # [R, hidden] model dtype: pre-norm residual stream (midlayer output + residual) at the
    # same rows; the `hidden_states` input of the next draft step.
    hidden_states: torch.Tensor


class Eagle3DecoderLayer(nn.Module):
    """The draft's single decoder layer (upstream `midlayer`); attention reads 2 * hidden."""

    def __init__(self, config, layer_id: int = 0, prefix: str = "midlayer") -> None:
        super().__init__()
        hidden = config.hidden_size
        o_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, layer_id, False, o_bias, f"{prefix}.self_attn")
        attn = self.self_attn
        attn.rope_in_decode = False  # LlamaAttention: not in the drafting steps' decode kernel
        attn.qkv_proj = QKVParallelLinear(  # replaces the hidden-wide one built by LlamaAttention
            2 * hidden,
            attn.head_dim,
            attn.qkv_proj.total_num_heads,
            attn.qkv_proj.total_num_kv_heads,
            bias=False,
            prefix=f"{prefix}.self_attn.qkv_proj",
        )
        self.mlp = LlamaMLP(
            hidden,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            bias=getattr(config, "mlp_bias", False),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        embeds: torch.Tensor,  # [T, H] token embeddings
        hidden_states: torch.Tensor,  # [T, H] fc(target aux) or the previous draft hidden
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output [T, H], residual [T, H]); their sum is the pre-norm stream."""
        residual = hidden_states
        attn_in = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], -1)
        attn_out = self.self_attn(positions, attn_in, forward_batch)  # [T, H]
        hidden, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLMEagle3(nn.Module):
    """EAGLE-3 draft model (upstream name). Its KV pool has one layer (layer_id 0).

    Args:
        config: HF LlamaConfig of the draft (num_hidden_layers 1); extra fields read:
            draft_vocab_size (absent: the target's lm_head and vocabulary are used, d2t is None),
            target_hidden_size (absent: hidden_size).
        target_hidden_size: overrides config.target_hidden_size.
    """

    def __init__(self, config, target_hidden_size: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.init_sizes(config, target_hidden_size)
        self.init_modules(config)
        self.init_vocab_maps()

    def init_sizes(self, config, target_hidden_size: int | None) -> None:
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.target_hidden_size: int = (
            target_hidden_size or getattr(config, "target_hidden_size", None) or self.hidden_size
        )
        draft_vocab = getattr(config, "draft_vocab_size", None)
        # lm_head from the target when the checkpoint has no draft vocabulary (upstream rule)
        self.lm_head_from_target: bool = draft_vocab is None
        self.draft_vocab_size: int = draft_vocab or config.vocab_size

    def init_modules(self, config) -> None:
        self.embed_tokens = VocabParallelEmbedding(
            self.vocab_size, self.hidden_size, prefix="embed_tokens"
        )
        self.fc = nn.Linear(
            3 * self.target_hidden_size, self.hidden_size, bias=bool(getattr(config, "bias", False))
        )
        self.fc.requires_grad_(False)
        self.midlayer = Eagle3DecoderLayer(config, 0, prefix="midlayer")
        self.norm = RMSNorm(self.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, self.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(SimpleNamespace(vocab_size=self.draft_vocab_size))

    def init_vocab_maps(self) -> None:
        if self.lm_head_from_target:
            self.d2t: torch.Tensor | None = None
            self.t2d: torch.Tensor | None = None
            return
        # d2t [draft_vocab] int64: target id = d2t[i] + i; t2d [vocab] bool: in the draft vocab
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))

    # ---- target sharing -------------------------------------------------------------------

    def set_embed(self, embed: torch.Tensor) -> None:
        """Use the target's embedding weight [vocab, hidden] (shared, not copied)."""
        if tuple(embed.shape) != (self.embed_tokens.num_embeddings_per_partition, self.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(embed.shape)}, the draft expects "
                f"[{self.embed_tokens.num_embeddings_per_partition}, {self.hidden_size}]"
            )
        self.embed_tokens.weight = _as_param(embed)

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor | None) -> None:
        """Share the target's embedding; also its lm_head [vocab, hidden] when the draft has no
        vocabulary of its own (draft_vocab_size absent). Raises ValueError on a shape mismatch
        or when the head is needed but None."""
        self.set_embed(embed)
        if not self.lm_head_from_target:
            return
        if head is None:
            raise ValueError("this draft has no draft_vocab_size: it needs the target's lm_head")
        if tuple(head.shape) != tuple(self.lm_head.weight.shape):
            raise ValueError(
                f"target lm_head has shape {tuple(head.shape)}, the draft expects "
                f"{tuple(self.lm_head.weight.shape)}"
            )
        self.lm_head.weight = _as_param(head)

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape, int64) -> target-vocabulary ids (same shape)."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    # ---- forward --------------------------------------------------------------------------

    def project_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target_hidden] target aux states -> fc -> [T, hidden]; [T, hidden] (the
        draft's own hidden) passes through. Raises ValueError for any other width."""
        width = hidden_states.shape[-1]
        if width == 3 * self.target_hidden_size and width != self.hidden_size:
            return self.fc(hidden_states)
        if width == self.hidden_size:
            return hidden_states
        raise ValueError(
            f"draft hidden_states width {width}: expected 3 * target_hidden "
            f"({3 * self.target_hidden_size}) or hidden ({self.hidden_size})"
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        forward_batch: ForwardBatch,
        hidden_states: torch.Tensor,  # [T, 3 * target_hidden] or [T, hidden]
    ) -> Eagle3DraftOutput:
        """One draft forward over the ragged batch (writes K/V of layer 0 at out_cache_loc).

        Returns logits [R, draft_vocab] float32 and the pre-norm hidden [R, hidden] at the rows
        forward_batch.logits_indices (R of them).
        """
        embeds = self.embed_tokens(input_ids)  # [T, H]
        hidden = self.project_hidden(hidden_states).to(embeds.dtype)  # [T, H]
        mlp_out, residual = self.midlayer(positions, embeds, hidden, forward_batch)
        normed, pre_norm = self.norm(mlp_out, residual)  # [T, H] each
        logits = self.logits_processor(normed, self.lm_head, forward_batch).next_token_logits
        return Eagle3DraftOutput(logits, pre_norm[forward_batch.logits_indices])

    # ---- weights --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (names with or without "model."); returns the names of the
        fully loaded parameters and buffers. embed_tokens is skipped (the target's is used).

        Raises ValueError for a tensor of the wrong shape, or d2t/t2d in a checkpoint whose
        config has no draft_vocab_size.
        """
        loader = StackedParamLoader(self)
        for raw_name, tensor in weights:
            name = raw_name.removeprefix("model.")
            if name.startswith("embed_tokens.") or "rotary_emb." in name:
                continue
            if name in ("d2t", "t2d"):
                self._load_vocab_map(name, tensor)
                loader.loaded.add(name)
                continue
            loader.load(name, tensor, reported_name=raw_name)
        loader.warn_unexpected(logger, "EAGLE-3 draft")
        return loader.loaded

    def _load_vocab_map(self, name: str, tensor: torch.Tensor) -> None:
        buf = getattr(self, name)
        if buf is None:
            raise ValueError(f"checkpoint has '{name}' but its config.json has no draft_vocab_size")
        if tuple(tensor.shape) != tuple(buf.shape):
            raise ValueError(
                f"checkpoint '{name}' has shape {tuple(tensor.shape)}, expected {tuple(buf.shape)}"
            )
        buf.copy_(tensor.to(buf.dtype))

    def required_weight_names(self) -> set[str]:
        """Parameter/buffer names a checkpoint must provide (not the shared embedding, nor the
        lm_head when it comes from the target)."""
        names = {n for n, _ in self.named_parameters() if not n.startswith("embed_tokens.")}
        if self.lm_head_from_target:
            names.discard("lm_head.weight")
        else:
            names |= {"d2t", "t2d"}
        return names


def _as_param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


EntryClass = [LlamaForCausalLMEagle3]
