"""Malformed requests, API keys and a full queue against a live server (tiny Llama, CPU): every
error is a 4xx/503 with an OpenAI-style body whose message names the problem, and the server
keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
import requests
from test_http_server import ServerProcess

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
LONG_TEXT = "word " * 2500  # > 2048-token context of the tiny model


def chat(**kw) -> dict:
    return {"model": "default", "messages": MSG, "max_tokens": 2, **kw}


def comp(**kw) -> dict:
    return {"model": "default", "prompt": "hi", "max_tokens": 2, **kw}


# (path, body: dict | bytes, status, text the error message must contain)
DEEP_500 = b"[" * 500 + b"]" * 500 + b"}"  # a JSON list nested 500 levels, closing the body
LP_START = {"input_ids": [1, 2, 3], "return_logprob": True}  # + a logprob_start_len
CASES = [
    (CHAT, b'{"model": "default", "messages": [', 400, "json"),
    (
        CHAT,
        b'{"model": "default", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        "utf-8",
    ),
    (CHAT, b"[1, 2, 3]", 400, "json object"),
    (CHAT, {"model": "default"}, 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hello"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "content"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    (CHAT, chat(max_tokens=10**9), 400, "max_tokens"),
    (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-5), 400, "max_completion_tokens"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(temperature=-1), 400, "temperature"),
    (CHAT, chat(top_p=2), 400, "top_p"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty="x"), 400, "frequency_penalty"),
    (CHAT, chat(top_logprobs=50, logprobs=True), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs"),  # without logprobs: true
    (CHAT, chat(stop=["ok", ""]), 400, "stop"),
    (CHAT, chat(stream=[1]), 400, "stream"),
    (CHAT, chat(model="gpt-17"), 404, "gpt-17"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format"),
    (COMP, comp(best_of=3), 400, "best_of is not supported other than equal to n"),
    (COMP, comp(best_of=1, n=2), 400, "best_of must be >= n"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice 'required' needs tools"),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400, "needs tools"),
    (COMP, comp(suffix="end"), 400, "suffix"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}]), 400, "context length"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_TEXT}], stream=True),
        400,
        "context length",
    ),
    (COMP, {"model": "default", "max_tokens": 2}, 400, "prompt"),
    (COMP, comp(prompt=[]), 400, "prompt"),
    (COMP, comp(prompt=5), 400, "prompt"),
    (COMP, comp(logprobs=100), 400, "logprobs"),
    (COMP, comp(prompt=[10**8]), 400, "token ids"),
    (COMP, comp(prompt=[1] * 3000), 400, "context length"),
    (COMP, comp(min_p=2), 400, "min_p"),
    (COMP, comp(repetition_penalty=0), 400, "repetition_penalty"),
    (COMP, comp(stop_token_ids=["a"]), 400, "stop_token_ids"),
    (COMP, comp(model="unknown-model"), 404, "unknown-model"),
    (GEN, b"{not json", 400, "json"),
    (GEN, {"sampling_params": {}}, 400, "text"),
    (GEN, {"text": "hi", "foo": 1}, 400, "foo"),
    (GEN, {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    (GEN, {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    (GEN, {"text": "hi", "stream": True, "sampling_params": {"top_p": 3}}, 400, "top_p"),
    (GEN, {"input_ids": ["a"]}, 400, "input_ids"),
    (GEN, {"text": ""}, 400, "text"),
    (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, 400, "max_new_tokens"),
    (GEN, LP_START | {"logprob_start_len": 3}, 400, "logprob_start_len"),
    (GEN, LP_START | {"logprob_start_len": -5}, 400, "logprob_start_len"),
    (GEN, {"text": LONG_TEXT}, 400, "context length"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}]}, 400, "one entry per prompt"),  # was 500
    (GEN, {"text": "a", "sampling_params": [{}]}, 400, "sampling_params"),
    # nesting: 5000 levels were a RecursionError (500) on /generate, ~966 on the OpenAI routes
    (GEN, b'{"text": "hi", "rid": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "user": ' + DEEP_500, 400, "nested"),
    # past FastAPI's parser's recursion (its refusal said "not valid UTF-8 JSON")
    (CHAT, b'{"model": "default", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested"),
    (
        COMP,
        b'{"model": "default", "prompt": "[{", "user": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        400,
        "nested",
    ),  # fmt: skip
    (COMP, b'{"model": "default", "prompt": "hi",', 400, "invalid JSON body"),
    ("/abort_request", {"id": "x"}, 400, "rid"),
    ("/no/such/route", {}, 404, "/no/such/route"),
    ("/metrics", {}, 404, "--enable-metrics"),  # metrics are off on this server
]


def gen(lp: dict | None = None, **sp) -> dict:
    """A /generate body: "hi", or the ids and logprob fields of `lp`, and sampling params."""
    return {"sampling_params": {"max_new_tokens": 2, **sp}, **(lp or {"text": "hi"})}


# Integer fields take JSON integers only on every route (OpenAI's API refuses 2.0 and true too):
# (path, body, the field the error must name)
INT_AS_FLOAT = [
    (CHAT, chat(max_tokens=2.0), "max_tokens"),
    (COMP, comp(max_tokens=True), "max_tokens"),
    (CHAT, chat(max_completion_tokens=2.0), "max_completion_tokens"),
    (CHAT, chat(n=1.0), "n"),
    (COMP, comp(n=True), "n"),
    (COMP, comp(top_k=5.0), "top_k"),
    (CHAT, chat(seed=3.0), "seed"),
    (COMP, comp(logprobs=2.0), "logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=2.0), "top_logprobs"),
    (COMP, comp(min_tokens=1.0), "min_tokens"),
    (COMP, comp(stop_token_ids=[2.0]), "stop_token_ids"),
    (GEN, gen(max_new_tokens=2.0), "max_new_tokens"),
    (GEN, gen(max_new_tokens=True), "max_new_tokens"),
    (GEN, gen(n=1.0), "n"),
    (GEN, gen(top_k=5.0), "top_k"),
    (GEN, gen(sampling_seed=3.0), "sampling_seed"),
    (GEN, gen(LP_START | {"top_logprobs_num": 2.0}), "top_logprobs_num"),
    (GEN, gen(LP_START | {"top_logprobs_num": True}), "top_logprobs_num"),  # crashed the scheduler
    (GEN, gen(LP_START | {"logprob_start_len": 0.0}), "logprob_start_len"),
]


@pytest.mark.parametrize(
    "path,body,field", INT_AS_FLOAT, ids=[str(i) for i in range(len(INT_AS_FLOAT))]
)
def test_integer_fields_refuse_floats_and_bools(server, path, body, field):
    err = _assert_openai_error(_send(server, path, body), 400, "integer")
    assert err["param"] == field
    must = rf"\b{field}'? must be (an integer|a list of integers)"
    assert re.search(must, err["message"]), err["message"]


def test_integral_values_as_integers_still_work(server):
    r = _send(server, CHAT, chat(n=2, seed=3, top_k=5, logprobs=True, top_logprobs=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = _send(server, COMP, comp(logprobs=2, temperature=1))  # an int where a float goes is fine
    assert r.status_code == 200, r.text
    sp = {"max_new_tokens": 2, "n": 1, "top_k": 5, "sampling_seed": 3, "temperature": 1}
    r = _send(server, GEN, {"text": "hi", "sampling_params": sp})
    assert r.status_code == 200, r.text


def test_top_logprobs_num_capped_like_openai(server):
    """/generate's top_logprobs_num has OpenAI's cap on top_logprobs / logprobs: 20."""
    err = _assert_openai_error(
        _send(server, GEN, gen(LP_START | {"top_logprobs_num": 21})), 400, "[0, 20]"
    )
    assert err["param"] == "top_logprobs_num"
    _assert_openai_error(_send(server, COMP, comp(logprobs=21)), 400, "logprobs")
    r = _send(server, GEN, gen(LP_START | {"top_logprobs_num": 20}))
    assert r.status_code == 200, r.text
    assert all(len(t) == 20 for t in r.json()["meta_info"]["output_top_logprobs"])


HUGE = [  # (path, raw body, field, the range the message must quote)
    (COMP, b'{"prompt": "hi", "max_tokens": 1e20}', "max_tokens", ">= 0, got 1e+20"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e20}', "max_tokens",
     ">= 1, got 1e+20"),
    (GEN, b'{"text": "hi", "sampling_params": {"max_new_tokens": 1e20}}', "max_new_tokens",
     ">= 0, got 1e+20"),
    (COMP, b'{"prompt": "hi", "top_k": 1e20}', "top_k", ">= -1, got 1e+20"),
    (COMP, b'{"prompt": "hi", "temperature": 1e400}', "temperature", ">= 0, got Infinity"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', "top_p",
     "in (0, 1], got NaN"),
    (GEN, b'{"text": "hi", "sampling_params": {"temperature": 1e400}}', "temperature",
     ">= 0, got Infinity"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,field,rng", HUGE, ids=[str(i) for i in range(len(HUGE))])
def test_huge_numbers_name_field_and_range(server, path, body, field, rng):
    """Numbers past int/float range: the message names the field and what it may be, and does
    not talk about Python types ("float") or JSON parsing."""
    err = _assert_openai_error(_send(server, path, body), 400, rng)
    assert err["param"] == field and f"{field} must be" in err["message"]
    assert "float" not in err["message"] and "parse" not in err["message"]


def test_prompt_too_long_same_wording_on_every_route(server):
    """Chat (checked before the engine) and completions / /generate (checked by the engine)
    say the same: the prompt's token count and the context length."""
    bodies = [
        (CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}])),
        (COMP, comp(prompt=LONG_TEXT)),
        (COMP, comp(prompt=[1] * 3000)),
        (GEN, {"text": LONG_TEXT}),
    ]
    pattern = re.compile(
        r"^The prompt is too long: (\d+) tokens, but the model's context length is 2048 tokens "
        r"and at least one token must remain for the output\.$"
    )
    for path, body in bodies:
        err = _assert_openai_error(_send(server, path, body), 400, "prompt is too long")
        m = pattern.match(err["message"])
        assert m and int(m.group(1)) > 2048, err["message"]
        assert err["code"] == "context_length_exceeded"


@pytest.fixture
def server(limits_server):
    """conftest.py's limits_server: 2 running, 4 queued, a 2048-token KV cache, an API key."""
    return limits_server


def _send(server: ServerProcess, path: str, body: dict | bytes) -> requests.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    if isinstance(body, bytes):
        return requests.post(server.base_url + path, data=body, headers=headers, timeout=60)
    return requests.post(server.base_url + path, json=body, headers=headers, timeout=60)


def _assert_openai_error(r: requests.Response, status: int, needle: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle.lower() in err["message"].lower(), err
    assert isinstance(err["type"], str) and err["type"]
    return err


def test_at_least_30_malformed_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("path,body,status,needle", CASES, ids=[str(i) for i in range(len(CASES))])
def test_malformed_request(server, path, body, status, needle):
    _assert_openai_error(_send(server, path, body), status, needle)


def test_server_still_healthy_after_errors(server):
    for path, body, _status, _needle in CASES[::5]:
        _send(server, path, body)
    assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200
    r = _send(server, CHAT, chat(temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain", None])
def test_json_body_without_json_content_type(server, ctype):
    """A JSON body is read as JSON whatever its Content-Type, as upstream: `curl -d` sends
    application/x-www-form-urlencoded, which the OpenAI routes refused ("must be a JSON
    object"). A body that is not JSON is still a 400."""
    headers = {k: v for k, v in server.headers.items() if k.lower() != "content-type"}
    if ctype is not None:
        headers["Content-Type"] = ctype
    gen_body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    url = server.base_url
    for path, body in [(CHAT, chat()), (COMP, comp()), (GEN, gen_body)]:
        r = requests.post(url + path, data=json.dumps(body), headers=headers, timeout=60)
        assert r.status_code == 200, (path, r.text)
    r = requests.post(url + CHAT, data="model=default", headers=headers, timeout=60)
    _assert_openai_error(r, 400, "json")


def test_validation_error_names_param(server):
    err = _assert_openai_error(_send(server, CHAT, chat(top_p=2)), 400, "top_p")
    assert err["param"] == "top_p" and err["type"] == "invalid_request_error"
    err = _assert_openai_error(_send(server, CHAT, chat(top_logprobs=3)), 400, "logprobs")
    assert err["param"] == "top_logprobs"  # a check across fields names the one at fault
    err = _assert_openai_error(_send(server, CHAT, chat(model="nope")), 404, "nope")
    assert err["param"] == "model" and err["code"] == "model_not_found"
    # engine errors that quote the bad value still name the parameter, not the value
    err = _assert_openai_error(_send(server, COMP, comp(logit_bias={"abc": 5})), 400, "abc")
    assert err["param"] == "logit_bias"


def test_context_length_errors_name_the_field(server):
    """A text prompt too long for the context (caught by the engine after tokenising) blames
    the prompt, not 'model' (a word of its message); max_tokens alone does not invent a
    prompt length. Both carry OpenAI's code context_length_exceeded."""
    err = _assert_openai_error(_send(server, COMP, comp(prompt=LONG_TEXT)), 400, "context")
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    err = _assert_openai_error(_send(server, COMP, comp(max_tokens=10**8)), 400, "max_tokens")
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert "prompt tokens" not in err["message"]  # the text prompt is not tokenised yet
    err = _assert_openai_error(_send(server, CHAT, chat(max_tokens=10**8)), 400, "max_tokens")
    assert "(+ " in err["message"] and err["code"] == "context_length_exceeded"


def test_api_key(server):
    url = server.base_url
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    missing = requests.post(url + GEN, json=body, timeout=30)
    assert _assert_openai_error(missing, 401, "missing api key")["code"] == "invalid_api_key"
    wrong = requests.post(
        url + GEN, json=body, headers={"Authorization": "Bearer nope"}, timeout=30
    )
    _assert_openai_error(wrong, 401, "invalid api key")
    _assert_openai_error(requests.get(url + "/v1/models", timeout=30), 401, "api key")
    assert requests.post(url + GEN, json=body, headers=server.headers, timeout=30).ok
    assert requests.get(url + "/health", timeout=30).status_code == 200  # open, as upstream


def _burst(server: ServerProcess, bodies: list[dict]) -> list[tuple[int, dict]]:
    """POST every /generate body at once; (status, JSON body) of each, in order."""

    async def one(session: aiohttp.ClientSession, body: dict) -> tuple[int, dict]:
        async with session.post(server.base_url + GEN, json=body) as r:
            return r.status, await r.json()

    async def burst() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession(headers=server.headers) as s:
            return await asyncio.gather(*[one(s, b) for b in bodies])

    return asyncio.run(burst())


def test_queue_full_gives_503(server):
    sp = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0}
    results = _burst(server, [{"text": "Tell a story", "sampling_params": sp}] * 10)
    codes = sorted(code for code, _ in results)
    assert codes.count(200) >= 4 and codes.count(503) >= 1 and set(codes) == {200, 503}, codes
    for code, body in results:
        if code == 503:
            assert body["error"]["code"] == "queue_full"
        else:
            assert body["meta_info"]["completion_tokens"] == 16
    assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200


def test_queue_full_counts_requests_waiting_for_kv(server):
    """--max-queued-requests bounds the scheduler's waiting queue whatever keeps requests
    waiting (upstream's rule), not only the running-request limit: prompts of 1,200 tokens
    in a 2,048-token KV cache run one at a time, so of 7 sent at once one runs, 4 wait and
    the rest are refused with 503 queue_full, although 7 in flight minus 2 running slots is
    within the limit of 4 as the tokenizer manager counts it (only 2 would be refused)."""
    sp = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.0}
    bodies = [{"input_ids": [100 + i] + [7 + i] * 1199, "sampling_params": sp} for i in range(7)]
    results = _burst(server, bodies)
    codes = sorted(code for code, _ in results)
    assert codes.count(503) >= 2 and codes.count(200) >= 1 and set(codes) == {200, 503}, codes
    for code, body in results:
        if code == 503:
            assert body["error"]["code"] == "queue_full"
            assert "max-queued-requests 4" in body["error"]["message"], body
        else:  # (a turn may end early, "KV cache is full", while the next prompt is chunked)
            assert 1 <= body["meta_info"]["completion_tokens"] <= 64, body["meta_info"]
    assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200


def test_validation_messages_read_like_openai(server):
    """pydantic's plumbing does not leak into messages: no "Value error, " prefix, one entry
    per field for a value that fits no branch of a union, a model-level check names its
    field, and a request without a body says so."""
    err = _assert_openai_error(_send(server, COMP, comp(stop="")), 400, "stop")
    assert "Value error" not in err["message"] and err["param"] == "stop"
    body = comp(stream_options={"include_usage": True})
    err = _assert_openai_error(_send(server, COMP, body), 400, "stream_options")
    assert "Value error" not in err["message"] and err["param"] == "stream_options"
    err = _assert_openai_error(_send(server, COMP, comp(prompt=123)), 400, "prompt")
    assert err["message"].count("prompt:") == 1 and err["param"] == "prompt"
    r = requests.post(server.base_url + COMP, headers=server.headers, timeout=60)
    err = _assert_openai_error(r, 400, "body is missing")
    assert err["param"] is None


def test_engine_errors_use_the_routes_field_names(server):
    """The OpenAI routes call the engine's min_new_tokens / max_new_tokens min_tokens /
    max_tokens (max_completion_tokens on chat when given) in messages and param; /generate
    keeps the engine's names."""
    err = _assert_openai_error(_send(server, COMP, comp(min_tokens=5)), 400, "min_tokens")
    assert "new_tokens" not in err["message"] and "max_tokens" in err["message"]
    assert err["param"] == "min_tokens"
    body = chat(max_tokens=None, max_completion_tokens=2, min_tokens=5)
    err = _assert_openai_error(_send(server, CHAT, body), 400, "max_completion_tokens")
    assert "new_tokens" not in err["message"]
    err = _assert_openai_error(_send(server, GEN, gen(min_new_tokens=5)), 400, "min_new_tokens")
    assert err["param"] == "min_new_tokens"
    # a completions prompt of token ids reaches the engine as input_ids
    err = _assert_openai_error(_send(server, COMP, comp(prompt=[99999999])), 400, "token ids")
    assert err["param"] == "prompt" and "input_ids" not in err["message"]
    body = {"input_ids": [99999999], "sampling_params": {"max_new_tokens": 2}}
    err = _assert_openai_error(_send(server, GEN, body), 400, "token ids")
    assert err["param"] == "input_ids"


def test_chat_max_tokens_must_be_positive(server):
    """OpenAI's chat API refuses max_tokens 0; completions and /generate take it (scoring)."""
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat(**{"max_tokens": None, field: 0})
        err = _assert_openai_error(_send(server, CHAT, body), 400, field)
        assert err["param"] == field
    r = _send(server, COMP, comp(max_tokens=0, echo=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(server):
    """A prompt of more characters than the context could hold in any tokenization is refused
    from its length alone (context_length_exceeded, naming characters, not tokens): on every
    text route, with the server serving on."""
    huge = "hello world " * 200_000  # 2.4 M characters, > 2048 tokens * 81 chars * 4
    for path, body, param in (
        (COMP, comp(prompt=huge), "prompt"),
        (CHAT, chat(messages=[{"role": "user", "content": huge}]), "messages"),
        (GEN, {"text": huge, "sampling_params": {"max_new_tokens": 2}}, "prompt"),
    ):
        err = _assert_openai_error(_send(server, path, body), 400, "characters")
        assert err["code"] == "context_length_exceeded" and err["param"] == param, path
    r = _send(server, COMP, comp(temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_choices_of_one_request_share_its_response_id(server):
    """With n > 1 every choice is its own engine request, but the response (and each stream
    chunk) carries the request's one id, as OpenAI's: no choice suffix."""
    r = _send(server, COMP, comp(n=2, temperature=0))
    one = _send(server, COMP, comp(temperature=0)).json()["id"]
    body = r.json()
    assert len(body["choices"]) == 2 and not body["id"].endswith("-0")
    assert len(body["id"]) == len(one)  # the same shape as a one-choice response's id
    stream = requests.post(
        server.base_url + CHAT, json=chat(n=2, stream=True), headers=server.headers,
        stream=True, timeout=60,
    )  # fmt: skip
    ids = {
        json.loads(line[6:])["id"]
        for line in stream.iter_lines(decode_unicode=True)
        if line.startswith("data: {")
    }
    assert len(ids) == 1 and not ids.pop().endswith("-0")
