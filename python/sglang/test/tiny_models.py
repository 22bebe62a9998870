"""Tiny random-weight checkpoints in HF layout, with the bundled model's real tokenizer, so
engine tests run in seconds but still tokenize, template and detokenize real text."""

from __future__ import annotations

import os
import shutil

import torch

from sglang.srt.model_loader.bundled import bundled_gguf_path
from sglang.srt.model_loader.gguf_convert import convert_gguf_to_hf
from sglang.srt.model_loader.weight_utils import save_safetensors_checkpoint

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def bundled_model_dir() -> str:
    """HF directory of the bundled SmolLM2-135M-Instruct (converted from GGUF on first use)."""
    return convert_gguf_to_hf(bundled_gguf_path())


def _hf_config(arch: str, **kw):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {
        "LlamaForCausalLM": LlamaConfig,
        "MistralForCausalLM": MistralConfig,
        "Qwen2ForCausalLM": Qwen2Config,
    }
    if arch not in classes:
        raise ValueError(f"make_tiny_model_dir supports {list(classes)}, not {arch!r}")
    if arch == "MistralForCausalLM":
        kw.setdefault("sliding_window", None)
    config = classes[arch](**kw)
    config.architectures = [arch]
    return config


def make_tiny_model_dir(
    path: str,
    arch: str = "LlamaForCausalLM",
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    weight_std: float = 0.5,
    **overrides,
) -> str:
    """Write a random-weight `arch` checkpoint (config.json, model.safetensors, tokenizer and
    generation config of the bundled model) into `path` and return `path`.

    Weights are normal(0, weight_std) (norm weights 1 + normal(0, 0.1)), seeded, in float32;
    the large std makes greedy outputs varied. vocab_size is the bundled model's (49152).
    `overrides` are extra HF config fields (e.g. tie_word_embeddings=False, rope_scaling=...).
    """
    src = bundled_model_dir()
    from transformers import AutoConfig

    bundled = AutoConfig.from_pretrained(src)
    kw = dict(
        vocab_size=bundled.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bundled.bos_token_id,
        eos_token_id=bundled.eos_token_id,
        pad_token_id=getattr(bundled, "pad_token_id", None),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    kw.update(overrides)
    config = _hf_config(arch, **kw)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    state = _random_state_dict(config, seed, weight_std)
    save_safetensors_checkpoint(
        state, os.path.join(path, "model.safetensors"), config.tie_word_embeddings
    )
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path


def _random_state_dict(config, seed: int, std: float) -> dict[str, torch.Tensor]:
    """HF-named random tensors for `config` (names and shapes taken from the HF model on the
    meta device, so they match what HF expects)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in hf.state_dict().items():
        if t.dim() == 1 and "norm" in name:
            state[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen, device="cpu")
        else:
            state[name] = std * torch.randn(t.shape, generator=gen, device="cpu")
    return state
