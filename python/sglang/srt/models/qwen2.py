"""Qwen2 for causal LM: the Llama architecture with biases on q/k/v (none on o_proj)."""

from __future__ import annotations

from sglang.srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same modules and weight names as LlamaForCausalLM; qkv_proj carries a bias."""

    @staticmethod
    def attention_bias(config) -> tuple[bool, bool]:
        return True, False


EntryClass = [Qwen2ForCausalLM]
