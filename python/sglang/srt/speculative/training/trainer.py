"""EAGLE-3 draft training loop: data -> target states -> training-time test -> checkpoint.

bf16 autocast (float32 master weights) on CUDA, float32 on CPU. The output directory receives a
standard EAGLE-3 checkpoint (config.json + model.safetensors, saved in bf16 on CUDA and float32
on CPU); resumable state lives in <output_dir>/train_state/.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import get_model, resolve_model_path
from sglang.srt.speculative.draft_config import (
    aux_layer_ids,
    build_draft_hf_config,
    eagle3_state_dict,
    save_eagle3_checkpoint,
)
from sglang.srt.speculative.training import data as data_mod
from sglang.srt.speculative.training.capture import capture_target_states, collate
from sglang.srt.speculative.training.draft_init import (
    draft_config_for_target,
    init_draft_model,
    trainable_parameters,
)
from sglang.srt.speculative.training.evaluate import evaluate_draft
from sglang.srt.speculative.training.ttt import ttt_unroll

logger = logging.getLogger(__name__)


def _arg(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = _arg("", "Where the EAGLE-3 checkpoint (and train_state/) are written.")
    target_model_path: str | None = _arg(None, "Target HF dir or .gguf (default: bundled).")
    num_prompts: int = _arg(512, "ShareGPT first turns to regenerate responses for.")
    prompts_path: str | None = _arg(
        None, "JSON list / JSONL ({'prompt': ...} or strings) of prompts instead of ShareGPT."
    )
    raw_prompts: bool = _arg(False, "Feed prompts as plain text, without the chat template.")
    max_new_tokens: int = _arg(256, "Max tokens of each regenerated response.")
    max_prompt_tokens: int = _arg(512, "Prompts longer than this (templated) are dropped.")
    temperature: float = _arg(0.0, "Sampling temperature of the regenerated responses.")
    draft_vocab_size: int = _arg(8192, "Draft vocabulary: the N most frequent target tokens.")
    steps: int | None = _arg(None, "Optimizer steps (default: --epochs over the data).")
    epochs: float = _arg(1.0, "Passes over the training sequences when --steps is not given.")
    ttt_steps: int = _arg(3, "Training-time-test unroll length (>= 3).")
    step_loss_decay: float = _arg(0.8, "Loss weight of unroll step k is decay ** k.")
    lr: float = _arg(3e-4, "Peak AdamW learning rate (linear warmup, cosine decay).")
    warmup_ratio: float = _arg(0.03, "Fraction of steps of linear warmup.")
    grad_clip: float = _arg(0.5, "Gradient norm clip.")
    batch_size: int = _arg(8, "Sequences per optimizer step.")
    eval_fraction: float = _arg(0.05, "Held-out share of sequences for the final evaluation.")
    seed: int = _arg(0, "Seed of prompt sampling, generation, init and batch order.")
    device: str = _arg("auto", "'cuda', 'cpu' or 'auto'.")
    resume: bool = _arg(False, "Continue from <output_dir>/train_state/state.pt.")
    save_every: int = _arg(500, "Save resumable state every N steps.")
    log_every: int = _arg(10, "Log loss and per-step accuracy every N steps.")
    capture_batch_tokens: int = _arg(16384, "Tokens per batched target capture forward.")
    mem_fraction_static: float | None = _arg(None, "Engine KV memory fraction (generation).")

    def validate(self) -> None:
        if not self.output_dir:
            raise ValueError("--output-dir is required")
        if self.ttt_steps < 3:
            raise ValueError(
                f"--ttt-steps must be >= 3 (EAGLE-3 training-time test), got {self.ttt_steps}"
            )
        if self.batch_size < 1 or self.num_prompts < 1 or self.draft_vocab_size < 1:
            raise ValueError("--batch-size, --num-prompts and --draft-vocab-size must be >= 1")


def _device_and_dtype(device: str) -> tuple[str, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, (torch.bfloat16 if device.startswith("cuda") else torch.float32)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def prepare_sequences(cfg: TrainConfig, target_path: str, device: str) -> list:
    """Self-distilled sequences, cached in train_state/sequences.json (reused when present)."""
    path = os.path.join(cfg.output_dir, "train_state", "sequences.json")
    if os.path.isfile(path):
        logger.info("Reusing regenerated data in %s", path)
        return data_mod.load_sequences(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    if cfg.prompts_path:
        prompts = data_mod.load_prompts_file(cfg.prompts_path)[: cfg.num_prompts]
    else:
        prompts = data_mod.sharegpt_first_turns(
            cfg.num_prompts, cfg.seed, exclude=data_mod.heldout_prompts()
        )
    prompt_ids = data_mod.prompt_token_ids(
        tokenizer, prompts, cfg.max_prompt_tokens, chat=not cfg.raw_prompts
    )
    logger.info("Regenerating %d responses with the target", len(prompt_ids))
    extra = {"mem_fraction_static": cfg.mem_fraction_static} if cfg.mem_fraction_static else {}
    seqs = data_mod.regenerate_responses(
        target_path, prompt_ids, cfg.max_new_tokens, cfg.temperature, cfg.seed, device, **extra
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data_mod.save_sequences(seqs, path)
    return seqs


def _lr_lambda(total: int, warmup: int):
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return fn


def _batch_order(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
    return [perm[i : i + batch_size].tolist() for i in range(0, n, batch_size)]


@dataclass
class _Setup:
    """Everything the loop needs, built once by _setup."""

    device: str
    dtype: torch.dtype
    train: tuple[list, list]  # (sequences, states)
    heldout: tuple[list, list]
    draft: torch.nn.Module
    draft_cfg: dict
    head: torch.Tensor  # target lm_head weight [V, H]
    hot: torch.Tensor  # [N] int64 target ids of the draft vocabulary


def _setup(cfg: TrainConfig) -> _Setup:
    device, dtype = _device_and_dtype(cfg.device)
    _seed_all(cfg.seed)
    target_path = resolve_model_path(cfg.target_model_path)
    seqs = prepare_sequences(cfg, target_path, device)
    n_eval = int(len(seqs) * cfg.eval_fraction)
    if len(seqs) - n_eval < 1:
        raise ValueError("no training sequences (all responses empty?)")
    mc = ModelConfig(target_path, dtype="auto", device=device)
    target = get_model(mc, device=device)
    vocab = mc.vocab_size
    hot = data_mod.select_draft_vocab(seqs[n_eval:], min(cfg.draft_vocab_size, vocab), vocab)
    d2t, t2d = data_mod.vocab_maps(hot, vocab)
    draft_cfg = draft_config_for_target(mc.hf_config, int(hot.numel()))
    layer_ids = aux_layer_ids(build_draft_hf_config(draft_cfg), mc.num_hidden_layers)
    t0 = time.perf_counter()
    # on CUDA the states stay in device memory (an H200 holds ~30M tokens' worth for
    # SmolLM2), so collating a batch is a device gather, not a host-to-device copy
    states = capture_target_states(
        target,
        mc,
        seqs,
        layer_ids,
        device,
        cfg.capture_batch_tokens,
        store_dtype=dtype,
        store_device=device if device.startswith("cuda") else "cpu",
    )
    logger.info(
        "Captured target states of %d sequences in %.1f s", len(seqs), time.perf_counter() - t0
    )
    embed, head = target.get_embed_and_head()
    draft = init_draft_model(draft_cfg, embed, head, d2t, t2d, cfg.seed, device=device)
    return _Setup(
        device,
        dtype,
        (seqs[n_eval:], states[n_eval:]),
        (seqs[:n_eval], states[:n_eval]),
        draft,
        draft_cfg,
        head.detach(),
        hot,
    )


def run_training(cfg: TrainConfig) -> str:
    """Train a draft per `cfg`; returns cfg.output_dir (a loadable EAGLE-3 checkpoint).

    Raises ValueError for bad options, missing data, or a --resume state that does not match.
    """
    cfg.validate()
    state_dir = os.path.join(cfg.output_dir, "train_state")
    os.makedirs(state_dir, exist_ok=True)
    su = _setup(cfg)
    train_seqs, train_states = su.train
    per_epoch = math.ceil(len(train_seqs) / cfg.batch_size)
    total = cfg.steps or max(1, math.ceil(per_epoch * cfg.epochs))
    params = trainable_parameters(su.draft)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, _lr_lambda(total, max(1, int(total * cfg.warmup_ratio)))
    )
    start = _maybe_resume(state_dir, su.draft, opt, sched, su.hot) if cfg.resume else 0
    autocast = dict(device_type=torch.device(su.device).type, dtype=su.dtype)
    autocast["enabled"] = su.dtype != torch.float32
    history: list[dict] = []
    bar = tqdm(range(start, total), initial=start, total=total, desc="EAGLE-3 training")
    for step in bar:
        epoch, pos = divmod(step, per_epoch)
        idx = _batch_order(len(train_seqs), cfg.batch_size, cfg.seed, epoch)[pos]
        batch = collate(
            [train_seqs[i] for i in idx], [train_states[i] for i in idx], su.device, su.dtype
        )
        with torch.autocast(**autocast):
            outs = ttt_unroll(su.draft, batch, su.head, cfg.ttt_steps)
        loss = sum((cfg.step_loss_decay**k) * o.loss for k, o in enumerate(outs))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        history.append(_step_metrics(step, loss, outs, sched.get_last_lr()[0]))
        _log_step(cfg, bar, history[-1], state_dir, total)
        if (step + 1) % cfg.save_every == 0 and step + 1 < total:
            _save_state(state_dir, su.draft, opt, sched, step + 1, su.hot, cfg)
    _save_state(state_dir, su.draft, opt, sched, total, su.hot, cfg)
    _finish(cfg, su, history, total)
    return cfg.output_dir


def _log_step(cfg: TrainConfig, bar, rec: dict, state_dir: str, total: int) -> None:
    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in rec["acc"]))
    if rec["step"] % cfg.log_every == 0 or rec["step"] == total:
        logger.info("step %d loss %.4f acc per position %s", rec["step"], rec["loss"], rec["acc"])
        with open(os.path.join(state_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


def _finish(cfg: TrainConfig, su: _Setup, history: list[dict], total: int) -> None:
    """Write the checkpoint (in the training dtype) and train_state/summary.json with the
    simulated greedy accept lengths on held-out and on (up to 32) training sequences."""
    state = {
        n: (t.to(su.dtype) if t.is_floating_point() else t)
        for n, t in eagle3_state_dict(su.draft).items()
    }
    save_eagle3_checkpoint(state, su.draft_cfg, cfg.output_dir)
    summary: dict = {"steps": total, "train_sequences": len(su.train[0])}
    summary["eval_sequences"] = len(su.heldout[0])
    summary["train_tokens"] = sum(len(s.input_ids) for s in su.train[0])
    if history:
        summary["first"], summary["last"] = history[0], history[-1]
    su.draft.eval()
    sets = {"eval": su.heldout, "train_eval": (su.train[0][:32], su.train[1][:32])}
    for key, (seqs, states) in sets.items():
        if seqs:
            summary[key] = evaluate_draft(
                su.draft, seqs, states, su.head, cfg.ttt_steps, su.device, su.dtype, cfg.batch_size
            )
            logger.info("%s: accept length (greedy, simulated) %s", key, summary[key])
    with open(os.path.join(cfg.output_dir, "train_state", "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def _step_metrics(step: int, loss: torch.Tensor, outs: list, lr: float) -> dict:
    acc = [round(o.correct.sum().item() / max(o.valid.sum().item(), 1), 4) for o in outs]
    return {
        "step": step + 1,
        "loss": loss.item(),
        "step_losses": [round(o.loss.item(), 4) for o in outs],
        "acc": acc,
        "lr": lr,
    }


def _save_state(state_dir, draft, opt, sched, step, hot, cfg) -> None:
    trainable = {n: p.detach().cpu() for n, p in draft.named_parameters() if p.requires_grad}
    tmp = os.path.join(state_dir, "state.pt.tmp")
    torch.save(
        {
            "step": step,
            "draft": trainable,
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "hot_ids": hot,
            "config": asdict(cfg),
        },
        tmp,
    )
    os.replace(tmp, os.path.join(state_dir, "state.pt"))


def _maybe_resume(state_dir, draft, opt, sched, hot) -> int:
    path = os.path.join(state_dir, "state.pt")
    if not os.path.isfile(path):
        logger.info("No state in %s: starting from scratch", path)
        return 0
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not torch.equal(state["hot_ids"], hot):
        raise ValueError("resume: the draft vocabulary differs from the saved state's")
    params = dict(draft.named_parameters())
    for name, t in state["draft"].items():
        params[name].data.copy_(t)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    logger.info("Resumed from step %d", state["step"])
    return int(state["step"])
