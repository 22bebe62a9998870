"""The bundled SmolLM2-135M-Instruct through the whole engine (float32, greedy) produces exactly
the tokens HF transformers' `generate` produces, for 5 chat prompts x 32 tokens, and the prompt
logprobs HF's logits give, from any logprob_start_len."""

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
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_outputs(hf_model) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    model = hf_model
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


def test_prompt_logprobs_match_hf(hf_model):
    """Prompt logprobs from logprob_start_len k: token t's log-softmax under HF's logits at
    position t - 1, for every t >= k; None only for token 0 (start 0). One engine serves all
    starts, so the later ones also read the prompt's prefix from the radix cache."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(bundled_model_dir()).encode(QUESTIONS[2] * 3)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    hf = [logprobs[t - 1, ids[t]].item() for t in range(1, len(ids))]  # tokens 1..
    params = {"temperature": 0, "max_new_tokens": 1}
    with Engine(dtype="float32") as engine:
        for start in (0, 9, -1):
            k = start if start >= 0 else len(ids) - 1
            got = engine.generate(
                input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=start
            )["meta_info"]["input_token_logprobs"]
            assert [tid for _, tid, _ in got] == ids[k:]
            if k == 0:
                assert got[0][0] is None
                got = got[1:]
            assert [lp for lp, _, _ in got] == pytest.approx(hf[max(k, 1) - 1 :], abs=1e-4), k
