"""A fresh EAGLE-3 draft for a target: its config (upstream format) and initial weights."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sglang.srt.speculative.draft_config import build_draft_hf_config, default_capture_layers


def draft_config_for_target(target_hf_config, draft_vocab_size: int | None = None) -> dict:
    """config.json dict of an EAGLE-3 draft shaped like the target (hidden, heads, intermediate
    size, RoPE, vocabulary). Targets too shallow for upstream's default aux layers get
    eagle_config.eagle_aux_hidden_state_layer_ids ([-1, 0, N - 1] below 4 layers, -1 being the
    embedding output; else [0, N // 2 - 1, N - 1])."""
    t = target_hf_config
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
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    if draft_vocab_size is not None:
        cfg["draft_vocab_size"] = draft_vocab_size
    n = t.num_hidden_layers
    default = default_capture_layers(n)
    if len(set(default)) != 3 or min(default) < 0:
        ids = [-1, 0, n - 1] if n < 4 else [0, n // 2 - 1, n - 1]
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    return cfg


def init_draft_model(
    cfg: dict,
    target_embed: torch.Tensor,
    target_head: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    seed: int = 0,
    std: float = 0.02,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLMEagle3:
    """A float32 draft on `device`: matrices normal(0, std) (seeded), norms 1, lm_head = the
    target's head rows of the draft vocabulary (copied), embedding shared with the target.
    All parameters but the embedding require grad."""
    with torch.device(device):
        draft = LlamaForCausalLMEagle3(build_draft_hf_config(cfg)).float()
    gen = torch.Generator().manual_seed(seed)
    for name, p in draft.named_parameters():
        if name.startswith("embed_tokens."):
            continue
        if p.dim() == 1:
            p.data.fill_(1.0 if "norm" in name else 0.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * std)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    hot = d2t + torch.arange(d2t.numel())
    draft.lm_head.weight.data.copy_(target_head.detach()[hot.to(target_head.device)].float())
    draft.set_embed(target_embed.detach().float())
    for name, p in draft.named_parameters():
        p.requires_grad_(not name.startswith("embed_tokens."))
    return draft


def trainable_parameters(draft: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens.")]
