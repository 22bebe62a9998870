"""Llama (and Mistral without sliding window) for causal LM over the paged KV pool.

Layout follows HF `LlamaForCausalLM` so checkpoints load by name; q/k/v and gate/up are fused
(qkv_proj, gate_up_proj) and attention goes through RadixAttention and the attention backend.
Qwen2 reuses every class here with different bias flags (models/qwen2.py). At one row on CUDA
(batch-1 decode) the decoder layer runs each RMSNorm inside the next GEMV and the MLP its
SiLU-and-mul inside down_proj's GEMV (layers/fused_linear.py); the results are those of the
unfused Triton kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.fused_linear import (
    linear_silu_mul,
    linear_silu_mul_applies,
    rmsnorm_linear,
    rmsnorm_linear_applies,
    silu_mul_linear,
    silu_mul_linear_applies,
)
from sglang.srt.layers.fused_rope_kv import decode_rope, rope_and_save_kv
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope, rope_params_from_config
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import StackedParamLoader

logger = logging.getLogger(__name__)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into gate_up_proj. At one row on CUDA
    under SGLANG_FUSED_GEMV_EPILOGUE=1 the gate_up GEMV writes silu(gate) * up itself
    (layers/fused_linear.linear_silu_mul); inside LlamaDecoderLayer only when the RMSNorm
    prologue is off (SGLANG_FUSED_GEMV_PROLOGUE=0), else gate_up runs in rmsnorm_linear and
    only `down` is called here."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"Unsupported activation {hidden_act!r}; only silu is supported")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if linear_silu_mul_applies(x, self.gate_up_proj):  # one row, the epilogue on: one kernel
            out, _ = self.down_proj(linear_silu_mul(x, self.gate_up_proj))  # act [1, I / tp]
            return out
        gate_up, _ = self.gate_up_proj(x)  # [T, 2 * I / tp]
        return self.down(gate_up)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I / tp] -> [T, H]
        """down_proj(silu(gate) * up); at one row on CUDA the SiLU-and-mul runs inside the
        down GEMV (layers/fused_linear.py), else SiluAndMul then down_proj."""
        if silu_mul_linear_applies(gate_up, self.down_proj):
            return silu_mul_linear(gate_up, self.down_proj)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class LlamaAttention(nn.Module):
    """GQA self-attention with RoPE; qkv_bias / o_bias select Llama (False/False, or
    attention_bias for both) or Qwen2 (True/False)."""

    def __init__(
        self, config, layer_id: int, qkv_bias: bool, o_bias: bool, prefix: str = ""
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv, bias=qkv_bias, prefix=f"{prefix}.qkv_proj"
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden, bias=o_bias, prefix=f"{prefix}.o_proj"
        )
        theta, scaling = rope_params_from_config(config)
        rotary_dim = int(self.head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self.rotary_emb = get_rope(
            self.head_dim, rotary_dim, config.max_position_embeddings, theta, scaling
        )
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )
        # Decode steps may leave RoPE and the KV store to the decode kernel (decode_rope): the
        # target's layers, whose decode token sits at req_to_token[row, seq_len - 1] =
        # out_cache_loc; the EAGLE-3 draft's layer turns it off (its drafting steps lay out
        # their slots on their own), and so does the EAGLE draft's.
        self.rope_in_decode = True

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor | None,  # [T, H] normed; not read when qkv is given
        forward_batch: ForwardBatch,
        qkv: torch.Tensor | None = None,  # [T, q_size + 2 * kv_size]: qkv_proj's output
    ) -> torch.Tensor:  # [T, H]
        if qkv is None:
            qkv, _ = self.qkv_proj(hidden_states)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # RoPE and the KV store: inside the decode kernel (SGLANG_FUSED_ROPE_DECODE), else
        # fused in one kernel when the step allows (layers/fused_rope_kv.py)
        rope = None
        if self.rope_in_decode:
            rope = decode_rope(self.rotary_emb, self.attn, positions, q, k, v, forward_batch)
        if rope is not None:
            attn_out = self.attn(q, k, v, forward_batch, save_kv_cache=False, rope=rope)
        else:
            q, k, kv_saved = rope_and_save_kv(
                self.rotary_emb, self.attn, positions, q, k, v, forward_batch
            )
            attn_out = self.attn(q, k, v, forward_batch, save_kv_cache=not kv_saved)
        # attn_out: [T, Hq * D]
        out, _ = self.o_proj(attn_out)
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. Carries the residual stream separately: forward returns
    (mlp output, residual) and the next layer's input norm adds them (fused add + norm)."""

    def __init__(
        self, config, layer_id: int, qkv_bias: bool, o_bias: bool, prefix: str = ""
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, o_bias, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor,  # [T, H]
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,  # [T, H] or None for the first layer
        aux: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """aux: when given, the layer's input residual stream (hidden_states + residual, [T, H])
        is appended to it (EAGLE-3 capture): the tensor its input norm computes anyway, a new
        one that nothing writes to later (every norm path returns a fresh residual)."""
        # At one row on CUDA each norm runs inside the GEMV after it (layers/fused_linear.py).
        norm, qkv_proj = self.input_layernorm, self.self_attn.qkv_proj
        if rmsnorm_linear_applies(norm, qkv_proj, hidden_states, residual):
            qkv, residual = rmsnorm_linear(norm, qkv_proj, hidden_states, residual)
            if aux is not None:
                aux.append(residual)
            hidden_states = self.self_attn(positions, None, forward_batch, qkv=qkv)
        else:
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            if aux is not None:
                aux.append(residual)
            hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        norm, gate_up_proj = self.post_attention_layernorm, self.mlp.gate_up_proj
        if rmsnorm_linear_applies(norm, gate_up_proj, hidden_states, residual):
            gate_up, residual = rmsnorm_linear(norm, gate_up_proj, hidden_states, residual)
            return self.mlp.down(gate_up), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm. layers_to_capture: indices of the layers whose
    INPUT residual stream (hidden + residual) is captured for EAGLE-3; index num_layers means
    the last layer's output."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, o_bias, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers_to_capture: list[int] = []

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,  # [T, H], replaces the embedding lookup
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (final normed hidden states [T, H], captured aux states, each [T, H], in
        layer order). A captured state is the residual stream that the captured layer's input
        norm (or the final norm) computes as hidden + residual anyway, not a separate add: three
        fewer kernels in every EAGLE-3 target step (a batch-1 SmolLM2 decode graph took 0.673
        ms with the capture against 0.659 without, H200, benchmark/results/
        decode_step_hostdiff_bs1_h200_s29.json)."""
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        aux: list[torch.Tensor] = []
        capture = self.layers_to_capture
        for i, layer in enumerate(self.layers):
            into = aux if i in capture else None
            hidden, residual = layer(positions, hidden, forward_batch, residual, into)
        hidden, stream = self.norm(hidden, residual)
        if len(self.layers) in capture:
            aux.append(stream)  # the last layer's output: hidden + residual
        return hidden, aux


class LlamaForCausalLM(nn.Module):
    """Llama causal LM. forward -> LogitsProcessorOutput (see LogitsProcessor.forward)."""

    def __init__(self, config, quant_config: object | None = None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("quantized checkpoints are not supported")
        self.config = config
        qkv_bias, o_bias = self.attention_bias(config)
        self.model = LlamaModel(config, qkv_bias, o_bias)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

    @staticmethod
    def attention_bias(config) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias): HF Llama uses config.attention_bias for both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> LogitsProcessorOutput:
        hidden, aux = self.model(input_ids, positions, forward_batch, input_embeds)
        aux_hidden = aux if self.capture_aux_hidden_states else None
        return self.logits_processor(hidden, self.lm_head, forward_batch, aux_hidden)

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        """Turn on EAGLE-3 capture (upstream semantics). Default: the inputs of layers
        [2, N // 2, N - 3]; `layer_ids` (eagle_aux_hidden_state_layer_ids) name layers whose
        OUTPUT is captured, i.e. the inputs of layers [i + 1 for i in layer_ids]."""
        self.capture_aux_hidden_states = True
        n = self.config.num_hidden_layers
        if layer_ids is None:
            self.model.layers_to_capture = [2, n // 2, n - 3]
        else:
            self.model.layers_to_capture = [i + 1 for i in layer_ids]

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding weight [V, H], lm_head weight [V, H]); the same tensor when tied."""
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Share another model's embedding and head tensors (draft models)."""
        self.model.embed_tokens.weight = _as_param(embed)
        self.lm_head.weight = _as_param(head)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    _SKIP = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of fully loaded parameters (a fused param
        counts once all its shards arrived). Unknown names are skipped with a warning."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        loader = StackedParamLoader(self)
        for name, tensor in weights:
            if any(s in name for s in self._SKIP) or (tied and name == "lm_head.weight"):
                continue
            loader.load(name, tensor)
        loader.warn_unexpected(logger, "Llama checkpoint")
        return loader.loaded


def _as_param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral = Llama layout; sliding windows shorter than the context are refused by
    ModelConfig, so attention is always full."""


EntryClass = [LlamaForCausalLM, MistralForCausalLM]
