"""Random-weight EAGLE-3 draft checkpoints for a given target directory, for tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from sglang.srt.speculative.draft_config import default_capture_layers, save_eagle3_checkpoint


def tiny_eagle3_config(target_dir: str, draft_vocab_size: int | None = None) -> dict:
    """config.json dict of an EAGLE-3 draft shaped for the target in `target_dir` (same hidden,
    heads, intermediate size, RoPE and vocabulary). Targets too shallow for upstream's default
    aux layers get eagle_aux_hidden_state_layer_ids [-1, 0, N - 1] ([-1 = embedding output])."""
    t = AutoConfig.from_pretrained(target_dir)
    rope = dict(getattr(t, "rope_parameters", None) or {})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": rope.get("rope_theta", getattr(t, "rope_theta", 10000.0)),
        "vocab_size": t.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": t.eos_token_id,
    }
    if draft_vocab_size is not None:
        cfg["draft_vocab_size"] = draft_vocab_size
    n = t.num_hidden_layers
    if len(set(default_capture_layers(n))) != 3 or min(default_capture_layers(n)) < 0:
        ids = [-1, 0, n - 1] if n < 4 else [0, n // 2 - 1, n - 1]
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    return cfg


def random_eagle3_state_dict(
    cfg: dict, seed: int = 0, std: float = 0.05
) -> dict[str, torch.Tensor]:
    """Checkpoint-named random tensors for config dict `cfg`: matrices normal(0, std), norm
    weights 1 + normal(0, 0.1), float32; d2t/t2d map draft id i to target id i (the first
    draft_vocab_size ids) when cfg has draft_vocab_size."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    draft_vocab = cfg.get("draft_vocab_size")
    shapes = {
        "fc.weight": (h, 3 * cfg.get("target_hidden_size", h)),
        "midlayer.self_attn.q_proj.weight": (nq * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nq * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
    }
    if draft_vocab is not None:
        shapes["lm_head.weight"] = (draft_vocab, h)
    state = {n: std * torch.randn(s, generator=gen) for n, s in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm"):
        state[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    state["midlayer.post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    state["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    if draft_vocab is not None:
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[:draft_vocab] = True
        state["t2d"] = t2d
    return state


def make_tiny_eagle3_dir(
    path: str,
    target_dir: str,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    std: float = 0.05,
) -> str:
    """Write a random EAGLE-3 checkpoint for the target in `target_dir` into `path`; returns
    `path`. draft_vocab_size None: no draft vocabulary (lm_head from the target)."""
    cfg = tiny_eagle3_config(target_dir, draft_vocab_size)
    return save_eagle3_checkpoint(random_eagle3_state_dict(cfg, seed, std), cfg, path)
