"""A tiny Llama's ragged prefill and decode steps over the real KV pool, for the tests that
compare the RoPE / KV-store paths (test_fused_rope_kv.py, test_fused_rope_decode.py)."""

from __future__ import annotations

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_loader import get_model
from sglang.test.forward_harness import ForwardHarness


def ragged_prefill_then_decode(
    model_dir: str, backend_cls, dtype: str, device: str, decode_steps: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model at model_dir (the tiny Llama: 2 layers, 4 heads, 2 KV heads, head_dim 16) in
    dtype on device, attention by backend_cls(): a ragged prefill of two requests (4 and 3
    tokens), then decode_steps decode steps of both (tokens 12 + 2s and 13 + 2s at step s).
    The first 5 KV slots are taken first, so the steps write slots 6 to 12 + 2 * decode_steps.
    Returns (each step's logits, the KV pool's k buffers then v buffers)."""
    cfg = ModelConfig(model_dir, dtype=dtype)
    model = get_model(cfg, device=device)
    harness = ForwardHarness(model, cfg, max_total_tokens=32, max_requests=2, device=device)
    harness.attn_backend = backend_cls()
    harness.allocator.alloc(5)  # not the first free slots
    a, b = harness.new_request(), harness.new_request()
    logits = [harness.forward([(a, [5, 6, 7, 8]), (b, [9, 10, 11])]).next_token_logits]
    for s in range(decode_steps):
        step = [(a, [12 + 2 * s]), (b, [13 + 2 * s])]
        logits.append(harness.forward(step, forward_mode=ForwardMode.DECODE).next_token_logits)
    pool = harness.token_to_kv_pool
    return logits, pool.k_buffer + pool.v_buffer
