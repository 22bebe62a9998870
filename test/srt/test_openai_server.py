"""OpenAI-compatible endpoints through the official `openai` client against a live server
(tiny random Llama, CPU): results must equal the native /generate for the same token ids.
Request checks (tool_choice, best_of, ignored fields) also run in-process, against the real app
over a stand-in TokenizerManager (no server needed)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import openai
import pytest
from test_http_server import ServerProcess
from transformers import AutoTokenizer

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.entrypoints.openai import serving_base

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


# ---- request checks, in-process --------------------------------------------------------------
class _StubTokenizer:
    chat_template = "stub"  # the tokenizer "has" a template: no ChatML fallback warning

    def apply_chat_template(self, messages: list[dict], **kw) -> str:
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * max(len(text), 1)


class _StubTM:
    """What the OpenAI routes use of a TokenizerManager; every request generates "ok"."""

    served_model_name = "m"
    server_args = SimpleNamespace(model_path="m")
    model_config = SimpleNamespace(context_len=64)
    tokenizer = _StubTokenizer()

    async def off_loop(self, fn, chars: int):
        return fn()

    def check_text_size(self, text: str, param: str) -> None:
        pass

    async def generate_request(self, obj):
        n = obj.sampling_params.get("n", 1)
        meta = {"id": obj.rid, "finish_reason": {"type": "length"}}
        meta |= {"prompt_tokens": 1, "completion_tokens": 1}
        outs = [{"text": "ok", "meta_info": {**meta, "index": i}} for i in range(n)]
        yield outs if n > 1 else outs[0]

    def abort_request(self, rid: str) -> None:
        pass


_ARGS = SimpleNamespace(
    api_key=None, enable_metrics=False, chat_template=None, model_path="m", log_requests=False
)


@pytest.fixture(scope="module")
def app():
    return create_app(_StubTM(), _ARGS)


def _post(app, path: str, body: dict) -> tuple[int, dict]:
    """POST a JSON body to the ASGI app; (status, JSON response)."""
    sent: list[dict] = []
    request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def receive() -> dict:
        nonlocal request
        if request is not None:
            msg, request = request, None
            return msg
        await asyncio.Event().wait()  # the client stays (is_disconnected cancels this)

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(data)


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP_BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}
FN = {"type": "function", "function": {"name": "get_weather"}}

REFUSED = [  # (path, extra fields, the error's exact message); param is the field at fault
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": []},
     "tool_choice 'required' needs tools"),
    ("/v1/chat/completions", {"tool_choice": FN},
     'tool_choice naming function "get_weather" needs tools'),
    ("/v1/chat/completions", {"tool_choice": FN, "tools": None},
     'tool_choice naming function "get_weather" needs tools'),
    ("/v1/chat/completions", {"tool_choice": "sometimes"},
     "tool_choice must be 'none', 'auto', 'required' or a function object, got \"sometimes\""),
    ("/v1/completions", {"best_of": 3},
     "best_of is not supported other than equal to n (got best_of=3, n=1); leave it out or set "
     "it to n"),
    ("/v1/completions", {"best_of": 3, "n": 2},
     "best_of is not supported other than equal to n (got best_of=3, n=2); leave it out or set "
     "it to n"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of must be >= n (got best_of=1, n=2)"),
]  # fmt: skip


@pytest.mark.parametrize("path,extra,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_tool_choice_and_best_of_refusals(app, path, extra, message):
    base = CHAT_BODY if path.endswith("chat/completions") else COMP_BODY
    status, body = _post(app, path, {**base, **extra})
    assert status == 400, body
    param = "best_of" if "best_of" in extra else "tool_choice"
    assert body == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


ACCEPTED = [  # (path, extra fields, choices expected)
    ("/v1/chat/completions", {"tool_choice": "none"}, 1),
    ("/v1/chat/completions", {"tool_choice": "auto", "tools": []}, 1),
    ("/v1/chat/completions", {"tool_choice": None}, 1),
    ("/v1/completions", {"best_of": None}, 1),
    ("/v1/completions", {"best_of": 1}, 1),
    ("/v1/completions", {"best_of": 2, "n": 2}, 2),
]


@pytest.mark.parametrize("path,extra,choices", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_tool_choice_without_forcing_and_best_of_equal_to_n_are_served(app, path, extra, choices):
    base = CHAT_BODY if path.endswith("chat/completions") else COMP_BODY
    status, body = _post(app, path, {**base, **extra})
    assert status == 200, body
    assert len(body["choices"]) == choices


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_fields_are_served_with_one_warning_naming_them(app, path, caplog):
    serving_base._warned_ignored.clear()  # the once-per-set memory of earlier tests
    base = CHAT_BODY if path.endswith("chat/completions") else COMP_BODY
    extras = {"lora_path": None, "zz_custom": 1}
    known = {"top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [2], "rid": "r1"}
    with caplog.at_level(logging.WARNING):
        status, body = _post(app, path, {**base, **known, **extras})
    assert status == 200 and len(body["choices"]) == 1, body
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{path}: ignored request fields (this server does not read them): 'lora_path', 'zz_custom'"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # only declared fields: no warning
        status, _ = _post(app, path, {**base, **known})
    assert status == 200 and caplog.records == []


def test_repeated_or_many_unknown_fields_do_not_flood_the_log(app, caplog):
    serving_base._warned_ignored.clear()
    many = {f"x{i:02d}": i for i in range(15)} | {"y" * 100: 0}
    with caplog.at_level(logging.DEBUG, logger=serving_base.logger.name):
        for _ in range(3):
            status, _ = _post(app, "/v1/completions", {**COMP_BODY, **many})
            assert status == 200
    records = [r for r in caplog.records if "ignored request fields" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    names = ", ".join(repr(f"x{i:02d}") for i in range(10))
    assert records[0].getMessage() == (
        "/v1/completions: ignored request fields (this server does not read them): "
        f"{names} and 6 more"
    )
    with caplog.at_level(logging.DEBUG, logger=serving_base.logger.name):
        caplog.clear()
        status, _ = _post(app, "/v1/completions", {**COMP_BODY, "y" * 100: 0})
    (record,) = [r for r in caplog.records if "ignored request fields" in r.getMessage()]
    assert record.levelno == logging.WARNING  # another set of names warns again
    assert record.getMessage().endswith(repr("y" * 64))  # a long name is cut


def test_unknown_field_warning_reaches_the_server_log(server, client):
    """Through the openai client's extra_body: served, and the server's log names the field."""
    r = client.completions.create(
        model="tiny-llama",
        prompt="hi",
        max_tokens=2,
        extra_body={"ignore_eos": True, "separate_reasoning": True},
    )
    assert r.usage.completion_tokens == 2
    line = "/v1/completions: ignored request fields (this server does not read them): "
    assert line + "'separate_reasoning'" in server.log_text()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny-llama", messages=FLAT, max_tokens=2, tool_choice="required"
        )
    assert e.value.status_code == 400 and "tool_choice 'required' needs tools" in str(e.value)
