"""Malformed requests, API keys and a full queue against a live server (tiny Llama, CPU): every
error is a 4xx/503 with an OpenAI-style body whose message names the problem, and the server
keeps serving afterwards."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests
from test_http_server import ServerProcess

KEY = "sk-test-key"
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
LONG_TEXT = "word " * 2500  # > 2048-token context of the tiny model


def chat(**kw) -> dict:
    return {"model": "default", "messages": MSG, "max_tokens": 2, **kw}


def comp(**kw) -> dict:
    return {"model": "default", "prompt": "hi", "max_tokens": 2, **kw}


# (path, body: dict | bytes, status, text the error message must contain)
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
    (COMP, comp(best_of=3), 400, "best_of"),
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
    ("/abort_request", {"id": "x"}, 400, "rid"),
    ("/no/such/route", {}, 404, "/no/such/route"),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(
        tiny_model_dir, "--max-queued-requests", "4", "--max-running-requests", "2", api_key=KEY
    )
    yield srv
    srv.stop()


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


def test_validation_error_names_param(server):
    err = _assert_openai_error(_send(server, CHAT, chat(top_p=2)), 400, "top_p")
    assert err["param"] == "top_p" and err["type"] == "invalid_request_error"
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


def test_queue_full_gives_503(server):
    async def one(session: aiohttp.ClientSession) -> tuple[int, dict]:
        sp = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0}
        body = {"text": "Tell a story", "sampling_params": sp}
        async with session.post(server.base_url + GEN, json=body) as r:
            return r.status, await r.json()

    async def burst() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession(headers=server.headers) as s:
            return await asyncio.gather(*[one(s) for _ in range(10)])

    results = asyncio.run(burst())
    codes = sorted(code for code, _ in results)
    assert codes.count(200) >= 4 and codes.count(503) >= 1 and set(codes) == {200, 503}, codes
    for code, body in results:
        if code == 503:
            assert body["error"]["code"] == "queue_full"
        else:
            assert body["meta_info"]["completion_tokens"] == 16
    assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200
