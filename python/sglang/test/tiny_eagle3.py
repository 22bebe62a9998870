"""Random-weight EAGLE-3 draft checkpoints for a given target directory, for tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from sglang.srt.speculative.draft_config import save_eagle3_checkpoint
from sglang.srt.speculative.training.draft_init import draft_config_for_target


def tiny_eagle3_config(target_dir: str, draft_vocab_size: int | None = None) -> dict:
    """config.json dict of an EAGLE-3 draft shaped for the target in `target_dir` (see
    draft_config_for_target: shallow targets get explicit eagle_aux_hidden_state_layer_ids)."""
    return draft_config_for_target(AutoConfig.from_pretrained(target_dir), draft_vocab_size)


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
    state = {n: std * torch.randn(s, generator=gen, device="cpu") for n, s in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm"):
        state[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen, device="cpu")
    state["midlayer.post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(
        h, generator=gen, device="cpu"
    )
    state["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen, device="cpu")
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


def train_tiny_draft(
    target_dir: str,
    out_dir: str,
    steps: int = 400,
    seed: int = 0,
    prompts: list[str] | None = None,
    max_new_tokens: int = 32,
    raw_prompts: bool = True,
    draft_vocab_size: int = 2048,
) -> str:
    """Train (CPU, float32) an EAGLE-3 draft for the tiny target in `target_dir` on its own
    greedy continuations of `prompts` (default: 24 ShareGPT first turns) and return `out_dir`.

    A random tiny target is unpredictable, so the draft is "often right" only on the prompts it
    was trained on: pass the prompts your test sends, as the Engine receives them (raw_prompts
    True: plain text; False: under the chat template) and the same max_new_tokens. Measured on
    the conftest 2-layer target with 20 prompts x 32 tokens and 400 steps: simulated greedy
    accept length 1.93 / 2.82 / 3.71 at K = 1 / 2 / 3 on those prompts (per-step accuracy
    0.97; train_state/summary.json, "train_eval"), in about 25 s on CPU.
    """
    import json
    import os

    from sglang.srt.speculative.training.trainer import TrainConfig, run_training

    extra: dict = {"num_prompts": 24}
    if prompts is not None:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "prompts.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(list(prompts), f)
        extra = {"prompts_path": path, "num_prompts": len(prompts)}
    cfg = TrainConfig(
        output_dir=out_dir,
        target_model_path=target_dir,
        max_new_tokens=max_new_tokens,
        raw_prompts=raw_prompts,
        draft_vocab_size=draft_vocab_size,
        steps=steps,
        batch_size=4,
        lr=3e-3,
        eval_fraction=0.0,
        seed=seed,
        device="cpu",
        log_every=max(steps // 5, 1),
        **extra,
    )
    return run_training(cfg)
