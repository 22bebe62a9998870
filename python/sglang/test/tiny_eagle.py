"""Random-weight EAGLE (v1/v2) draft checkpoints in the upstream format, for tests.

Layout written (SafeAILab/EAGLE cnets.py state dict, as served by upstream SGLang's
LlamaForCausalLMEagle): config.json = the target's config with architectures
["LlamaForCausalLMEagle"] and num_hidden_layers N; model.safetensors with fc.weight [H, 2H],
fc.bias [H], layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
layers.{i}.post_attention_layernorm.weight, layers.{i}.input_layernorm.weight for i >= 1 only,
and embed_tokens.weight (a copy of the target's, as EAGLE training saves it).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from sglang.srt.model_loader.weight_utils import checkpoint_weights_iterator


def tiny_eagle_config(target_dir: str, num_layers: int = 1) -> dict:
    """config.json dict of an EAGLE draft for the target in `target_dir`: the target's config
    with architectures ["LlamaForCausalLMEagle"] and num_hidden_layers `num_layers`."""
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LlamaForCausalLMEagle"]
    cfg["num_hidden_layers"] = num_layers
    cfg["model_type"] = "llama"
    return cfg


def random_eagle_state_dict(
    cfg: dict,
    target_dir: str | None = None,
    seed: int = 0,
    std: float = 0.05,
    fc_bias: bool = True,
) -> dict[str, torch.Tensor]:
    """Checkpoint-named random tensors for config dict `cfg` (float32): matrices normal(0, std),
    biases normal(0, std), norm weights 1 + normal(0, 0.1). With `target_dir`, also
    embed_tokens.weight copied from the target checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq

    def rand(*shape: int) -> torch.Tensor:
        return std * torch.randn(shape, generator=gen, device="cpu")

    state = {"fc.weight": rand(h, 2 * h)}
    if fc_bias:
        state["fc.bias"] = rand(h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        state[p + "self_attn.q_proj.weight"] = rand(nq * hd, h)
        state[p + "self_attn.k_proj.weight"] = rand(nkv * hd, h)
        state[p + "self_attn.v_proj.weight"] = rand(nkv * hd, h)
        state[p + "self_attn.o_proj.weight"] = rand(h, nq * hd)
        state[p + "mlp.gate_proj.weight"] = rand(inter, h)
        state[p + "mlp.up_proj.weight"] = rand(inter, h)
        state[p + "mlp.down_proj.weight"] = rand(h, inter)
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if i > 0 else [])
        for norm in norms:
            state[f"{p}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen, device="cpu")
    if target_dir is not None:
        for name, t in checkpoint_weights_iterator(target_dir):
            if name == "model.embed_tokens.weight":
                state["embed_tokens.weight"] = t.float().clone()
    return state


def make_tiny_eagle_dir(
    path: str,
    target_dir: str,
    seed: int = 0,
    num_layers: int = 1,
    std: float = 0.05,
    prefix: str = "",
    fc_bias: bool = True,
) -> str:
    """Write a random upstream-format EAGLE checkpoint for the target in `target_dir` into
    `path` (config.json + model.safetensors); returns `path`. `prefix` (e.g. "model.") is put
    before every tensor name."""
    cfg = tiny_eagle_config(target_dir, num_layers)
    state = random_eagle_state_dict(cfg, target_dir, seed, std, fc_bias)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    tensors = {prefix + n: t.contiguous() for n, t in state.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def load_eagle_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint written by make_tiny_eagle_dir, names without prefix."""
    sd = load_file(os.path.join(path, "model.safetensors"))
    return {n.removeprefix("model."): t for n, t in sd.items()}
