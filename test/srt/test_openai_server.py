"""OpenAI-compatible endpoints through the official `openai` client against a live server
(tiny random Llama, CPU): results must equal the native /generate for the same token ids."""

from __future__ import annotations

import openai
import pytest
from test_http_server import ServerProcess
from transformers import AutoTokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
PARTS = [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour."}]
MESSAGES = [SYSTEM, {"role": "user", "content": PARTS}]  # content as text parts
FLAT = [SYSTEM, {"role": "user", "content": "Name a colour."}]  # the same, as one string


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--served-model-name", "tiny-llama")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def native(server: ServerProcess, ids: list[int], n: int, **extra) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
    return server.post("/generate", {"input_ids": ids, "sampling_params": sp, **extra}).json()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_chat_equals_native_generate(server, client, tokenizer):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ids = chat_ids(tokenizer, FLAT)
    ref = native(server, ids, 6)
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
    assert r.usage.total_tokens == len(ids) + 6


def test_completions_equals_native_and_max_completion_tokens(server, client, tokenizer):
    r = client.completions.create(
        model="tiny-llama",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ref = native(server, tokenizer.encode("Once upon a time"), 5)
    assert r.choices[0].text == ref["text"] and r.usage.completion_tokens == 5
    c = client.chat.completions.create(
        model="default",
        messages=FLAT,
        temperature=0,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert c.usage.completion_tokens == 3


def test_chat_stream_with_usage(client):
    kw = dict(
        model="tiny-llama",
        messages=FLAT,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stream(client):
    kw = dict(
        model="tiny-llama",
        prompt="Count: one, two,",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_n2_returns_two_choices(client):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=FLAT,
        max_tokens=4,
        n=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    assert r.usage.completion_tokens == 8
    single = client.chat.completions.create(
        model="tiny-llama",
        messages=FLAT,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    c = client.completions.create(
        model="tiny-llama",
        prompt=["a b", "c d"],
        max_tokens=2,
        n=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert c.choices[0].text == c.choices[1].text and c.choices[2].text == c.choices[3].text


def test_completion_logprobs_match_native(server, client, tokenizer):
    r = client.completions.create(
        model="tiny-llama",
        prompt="The sky is",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    ref = native(server, tokenizer.encode("The sky is"), 4, return_logprob=True, top_logprobs_num=2)
    lp = r.choices[0].logprobs
    expected = [e[0] for e in ref["meta_info"]["output_token_logprobs"]]
    assert lp.token_logprobs == pytest.approx(expected, rel=1e-4)  # prefix-cache numerics
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=FLAT,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert bytes(t.bytes).decode("utf-8") == t.token


def test_stop_string(client):
    base = client.completions.create(
        model="tiny-llama",
        prompt="Once upon a time",
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    r = client.completions.create(
        model="tiny-llama",
        prompt="Once upon a time",
        temperature=0,
        max_tokens=8,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].model_extra["matched_stop"] == stop


def test_seed_reproducible(client):
    kw = dict(
        model="tiny-llama",
        prompt="Random words:",
        max_tokens=6,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    other = client.completions.create(**kw, seed=7).choices[0].text
    assert a == b
    assert other != a  # the seed does change the sample
