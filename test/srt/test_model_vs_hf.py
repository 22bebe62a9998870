"""The bundled SmolLM2-135M-Instruct in float32 against HF transformers loaded from the same
converted directory: ragged 5-prompt prefill, chunked prefill through the KV pool, decode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_loader import get_model
from sglang.test.forward_harness import ForwardHarness
from sglang.test.tiny_models import bundled_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def setup():
    path = bundled_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    cfg = ModelConfig(path, dtype="float32")
    ours = get_model(cfg)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return cfg, ours, hf, prompts


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [T, V] float32
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prompts_are_chatml(setup):
    _, _, _, prompts = setup
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    text = tok.decode(prompts[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>" in text


def test_ragged_prefill_logits_match_hf(setup):
    cfg, ours, hf, prompts = setup
    harness = ForwardHarness(ours, cfg)
    reqs = [(harness.new_request(), p) for p in prompts]
    logits = harness.forward(reqs, all_logits=True).next_token_logits
    assert logits.shape == (sum(map(len, prompts)), 49152)
    for mine, ids in zip(logits.split([len(p) for p in prompts]), prompts, strict=True):
        ref = _hf_logits(hf, ids)
        assert (mine - ref).abs().max().item() < 1e-3
        assert torch.equal(mine[-1].argmax(), ref[-1].argmax())


def test_chunked_prefill_and_decode_match_one_shot(setup):
    cfg, ours, hf, prompts = setup
    ids = prompts[2]
    cut = len(ids) // 3
    harness = ForwardHarness(ours, cfg)
    whole = harness.forward([(harness.new_request(), ids)]).next_token_logits  # [1, V]
    slot = harness.new_request()
    harness.forward([(slot, ids[:cut])])
    chunked = harness.forward([(slot, ids[cut:])]).next_token_logits
    assert (chunked - whole).abs().max().item() < 1e-4

    # three greedy decode steps on top of the chunked KV, then one HF pass over the whole
    # sequence checks the logits of every step
    seq, steps = list(ids), [chunked[0]]
    for _ in range(3):
        seq.append(int(steps[-1].argmax()))
        out = harness.forward([(slot, seq[-1:])], forward_mode=ForwardMode.DECODE)
        steps.append(out.next_token_logits[0])
    ref = _hf_logits(hf, seq)[len(ids) - 1 :]  # [4, V]: rows predicting each new token
    assert (torch.stack(steps) - ref).abs().max().item() < 1e-3
