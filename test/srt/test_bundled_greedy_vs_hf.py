"""The bundled SmolLM2-135M-Instruct through the whole engine (float32, greedy) produces exactly
the tokens HF transformers' `generate` produces, for 5 chat prompts x 32 tokens."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.test.engine_checks import assert_no_kv_leak
from sglang.test.tiny_models import bundled_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying healthy.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_outputs() -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, outs = [], []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out_ids: list[int] = []
        with torch.no_grad():  # plain greedy loop over HF's KV cache; EOS is not special
            out = model(torch.tensor([ids]), use_cache=True)
            for _ in range(NEW_TOKENS):
                nxt = int(out.logits[0, -1].argmax())
                out_ids.append(nxt)
                out = model(
                    torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True
                )
        prompts.append(ids)
        outs.append(out_ids)
    return prompts, outs


def test_bundled_greedy_matches_hf(hf_outputs):
    prompts, expected = hf_outputs
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(dtype="float32") as engine:  # model_path omitted: the bundled model
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        assert all(o["meta_info"]["completion_tokens"] == NEW_TOKENS for o in outs)
        assert_no_kv_leak(engine)


def test_bundled_draft_is_default_and_lossless(hf_outputs):
    """`--speculative-algorithm EAGLE3` on the bundled model uses the bundled trained draft;
    greedy output still equals HF transformers token for token, and the draft is often right."""
    prompts, expected = hf_outputs
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(dtype="float32", speculative_algorithm="EAGLE3") as engine:
        assert engine.server_args.speculative_draft_model_path.endswith("smollm2_eagle3")
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
        proposed = sum(o["meta_info"]["spec_num_proposed_drafts"] for o in outs)
        assert proposed > 0 and correct / proposed > 0.1  # a random draft: ~0
        assert_no_kv_leak(engine)
