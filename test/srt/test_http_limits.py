"""Request limits that every route must apply alike, against conftest.py's limits_server (tiny
Llama on CPU, context 2048, KV cache 2048 tokens, 2 running, 4 queued): the longest prompt
(the HTTP check and the scheduler share one rule), n, logit_bias and the max_tokens wording,
and a /generate stream whose client leaves before its first chunk. Every refusal is a 400 with
an OpenAI error body naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
import requests
from test_http_errors import _assert_openai_error, _send, chat, comp
from test_http_server import ServerProcess, sse_events

from sglang.srt.managers.request_validation import max_prompt_len, prompt_too_long_message
from sglang.test.scheduler_utils import collect, make_scheduler, run_until_idle, submit

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
CTX = KV = 2048  # the tiny model's context; limits_server's --max-total-tokens
LONGEST = 2046  # KV - 2: the scheduler's rule (prompt_len < min(CTX, KV - 1))


@pytest.fixture
def server(limits_server):
    return limits_server


def _served(r: requests.Response) -> None:
    assert r.status_code == 200, r.text


def _healthy(server: ServerProcess) -> None:
    r = _send(server, GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


# ---- longest prompt --------------------------------------------------------------------------
def test_max_prompt_len_is_the_schedulers_rule():
    assert max_prompt_len(CTX, KV) == LONGEST
    assert max_prompt_len(2048, None) == max_prompt_len(2048, 10**6) == 2047  # context binds
    assert max_prompt_len(2048, 1000) == 998


def test_prompt_length_boundary_over_http(server):
    """LONGEST + 1 tokens passed the HTTP check (< context, < KV) and the scheduler then
    aborted it with a 200; now it is a 400 on every route, and LONGEST tokens are served."""
    too_long = [1] * (LONGEST + 1)
    want = (
        f"The prompt is too long: {LONGEST + 1} tokens, but the KV cache of this server holds "
        f"{KV} tokens and a prompt may use at most {LONGEST} of them."
    )
    assert prompt_too_long_message(LONGEST + 1, CTX, KV) == want
    for path, body in [
        (GEN, {"input_ids": too_long}),
        (GEN, {"input_ids": too_long, "stream": True}),
        (COMP, comp(prompt=too_long, max_tokens=1)),
        (COMP, comp(prompt=too_long, max_tokens=1, stream=True)),
    ]:
        err = _assert_openai_error(_send(server, path, body), 400, "prompt is too long")
        assert err == {
            "message": want,
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    r = _send(server, GEN, {"input_ids": [1] * LONGEST, "sampling_params": {"max_new_tokens": 1}})
    _served(r)
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == LONGEST and meta["finish_reason"]["type"] == "length"
    r = _send(server, COMP, comp(prompt=[1] * LONGEST, max_tokens=1))
    _served(r)
    assert r.json()["usage"]["prompt_tokens"] == LONGEST
    assert r.json()["choices"][0]["finish_reason"] == "length"
    _healthy(server)


def test_prompt_length_boundary_in_the_scheduler(tiny_model_dir):
    """The scheduler (reached without the tokenizer manager's check) applies the same rule and
    wording: a KV cache of 64 tokens takes prompts of up to 62."""
    sched = make_scheduler(tiny_model_dir, device="cpu", max_total_tokens=64)
    longest = max_prompt_len(sched.model_config.context_len, 64)
    assert longest == 62
    submit(sched, "fits", [1] * longest, {"max_new_tokens": 1})
    submit(sched, "too-long", [1] * (longest + 1), {"max_new_tokens": 1})
    outputs: dict[str, dict] = {}
    collect(sched, outputs)
    run_until_idle(sched, outputs)
    assert outputs["too-long"]["finish"] == {
        "type": "abort",
        "matched": None,
        "message": prompt_too_long_message(longest + 1, sched.model_config.context_len, 64),
    }
    assert outputs["too-long"]["output_ids"] == []
    assert outputs["fits"]["finish"]["type"] == "length"
    assert len(outputs["fits"]["output_ids"]) == 1


# ---- n ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [129, 10**9, 0])
def test_n_capped_alike_on_every_route(server, n):
    """/generate had no cap on n (10**9 copies of the request); all routes now say the same."""
    want = f"n must be an integer in [1, 128], got {n}"
    for path, body in [
        (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": n}}),
        (GEN, {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 1, "n": n}}),
        (CHAT, chat(n=n)),
        (COMP, comp(n=n)),
    ]:
        err = _assert_openai_error(_send(server, path, body), 400, want)
        assert err["message"] == want and err["param"] == "n", (path, err)
    _healthy(server)


# ---- logit_bias ------------------------------------------------------------------------------
BAD_BIAS = [  # (raw logit_bias JSON, what the message must say)
    ('{"5": 101}', 'logit_bias["5"] must be a number in [-100, 100], got 101'),
    ('{"5": -100.5}', 'logit_bias["5"] must be a number in [-100, 100], got -100.5'),
    ('{"5": 1e400}', 'logit_bias["5"] must be a number in [-100, 100], got Infinity'),
    ('{"5": NaN}', 'logit_bias["5"] must be a number in [-100, 100], got NaN'),
    ('{"5": "high"}', 'logit_bias["5"] must be a number in [-100, 100], got "high"'),
    ('{"5": true}', 'logit_bias["5"] must be a number in [-100, 100], got true'),
    ('{"5": null}', 'logit_bias["5"] must be a number in [-100, 100], got null'),
    ('{"five": 1}', 'logit_bias key "five" is not a token id'),
    ('{"5.0": 1}', 'logit_bias key "5.0" is not a token id'),
    ('{"99999999": 1}', 'logit_bias key "99999999" is outside vocab [0, '),
    ('{"-1": 1}', 'logit_bias key "-1" is outside vocab [0, '),
    ("[5]", "logit_bias must be a dict of token id -> float, got [5]"),
]


@pytest.mark.parametrize("bias,needle", BAD_BIAS, ids=[str(i) for i in range(len(BAD_BIAS))])
def test_logit_bias_checked_on_every_route(server, bias, needle):
    bodies = [
        (GEN, '{"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": %s}}'),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "logit_bias": %s}'),
        (COMP, '{"prompt": "hi", "max_tokens": 1, "logit_bias": %s}'),
    ]
    for path, body in bodies:
        r = _send(server, path, (body % bias).encode())
        if path != GEN and bias == "[5]":  # pydantic's own type error, naming the field
            assert _assert_openai_error(r, 400, "logit_bias")["param"] == "logit_bias"
            continue
        err = _assert_openai_error(r, 400, needle)
        assert err["param"] == "logit_bias", (path, err)


def test_logit_bias_at_the_limits_is_applied(server):
    """+-100 are accepted, and +100 on one token makes greedy decoding pick it every step."""
    sp = {"max_new_tokens": 4, "temperature": 0, "logit_bias": {"42": 100, "43": -100}}
    r = _send(server, GEN, {"text": "hi", "sampling_params": sp})
    _served(r)
    assert r.json()["output_ids"] == [42] * 4
    r = _send(server, COMP, comp(max_tokens=3, temperature=0, logit_bias={"42": 100.0}))
    _served(r)
    assert r.json()["usage"]["completion_tokens"] == 3


# ---- max_tokens too large --------------------------------------------------------------------
def test_max_tokens_too_large_same_wording_on_every_route(server):
    """One wording (request_validation.max_tokens_too_large_message), naming the route's field:
    max_new_tokens on /generate, max_tokens / max_completion_tokens on the OpenAI routes."""
    ids = [1] * 10
    cases = [
        (GEN, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2040}}, "max_new_tokens"),
        (
            GEN,
            {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 2040}},
            "max_new_tokens",
        ),
        (COMP, comp(prompt=ids, max_tokens=2040), "max_tokens"),
        (COMP, comp(prompt="hi " * 20, max_tokens=2040, stream=True), "max_tokens"),
        (CHAT, chat(max_tokens=2040), "max_tokens"),
        (CHAT, chat(max_completion_tokens=2040, stream=True), "max_completion_tokens"),
    ]
    for path, body, field in cases:
        err = _assert_openai_error(_send(server, path, body), 400, "too large")
        m = re.fullmatch(
            rf"{field} is too large: 2040 \(\+ (\d+) prompt tokens\) exceeds the model's "
            r"context length of 2048 tokens\.",
            err["message"],
        )
        assert m and int(m.group(1)) > 8, (path, err)
        assert err["param"] == field and err["code"] == "context_length_exceeded", (path, err)
    _healthy(server)


# ---- client gone before the first chunk ------------------------------------------------------
def _wait_for(server: ServerProcess, ok, timeout_s: float = 10.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        state = server.internal_state()
        if ok(state):
            return state
        if time.time() > deadline:
            raise AssertionError(f"timed out; server state: {state}")
        time.sleep(0.05)


def _open_busy_stream(server: ServerProcess, rid: str) -> requests.Response:
    sp = {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True}
    body = {"text": "Tell me a very long story.", "stream": True, "rid": rid, "sampling_params": sp}
    resp = requests.post(
        server.base_url + GEN, json=body, headers=server.headers, stream=True, timeout=60
    )
    assert resp.status_code == 200, resp.text
    return resp


def test_stream_client_gone_before_first_chunk_is_a_clean_abort(server):
    """The 2 running slots are busy, so a third stream waits in the queue without a first chunk;
    its client leaves. It used to log two tracebacks (the route did not catch ClientGone); now
    it is aborted quietly, the busy requests keep running, and no KV leaks."""
    log_start = len(server.log_text())
    busy = [_open_busy_stream(server, f"busy-{i}") for i in range(2)]
    body = json.dumps({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4}})
    head = (
        f"POST {GEN} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: {server.headers['Authorization']}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + body.encode())
        _wait_for(server, lambda s: s["num_waiting_reqs"] == 1 and s["num_running_reqs"] == 2)
    # the client is gone: the queued request leaves the queue while the busy ones run on
    state = _wait_for(server, lambda s: s["num_waiting_reqs"] == 0)
    assert state["num_running_reqs"] == 2
    for i, resp in enumerate(busy):
        assert _send(server, "/abort_request", {"rid": f"busy-{i}"}).status_code == 200
        events = sse_events(resp)
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] in (
            "abort",
            "length",
        )
    _wait_for(
        server,
        lambda s: (
            s["num_running_reqs"] == 0
            and s["kv_available_tokens"] + s["radix_cache_tokens"] == s["kv_pool_size"]
        ),
    )
    _healthy(server)
    log = server.log_text()[log_start:]
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


# ---- text that is not Unicode, strict booleans, field combinations -----------------------------
SURROGATE = b"a\\udc80b"  # JSON allows the escape; the decoded str cannot be UTF-8 encoded


def _raw(obj: dict, marker: str = "@S@") -> bytes:
    """obj as JSON with every marker string replaced by a lone-surrogate escape."""
    return json.dumps(obj).encode().replace(marker.encode(), SURROGATE)


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, chat(messages=[{"role": "user", "content": "@S@"}]), "messages[0].content"),
        (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "@S@"}]}]),
            "messages[0].content[0].text",
        ),
        (CHAT, chat(stop=["ok", "@S@"]), "stop[1]"),
        (COMP, comp(prompt="@S@"), "prompt"),
        (COMP, comp(prompt=["x", "@S@"]), "prompt[1]"),
        (GEN, {"text": "@S@"}, "text"),
        (GEN, {"text": "hi", "sampling_params": {"stop": ["@S@"]}}, "sampling_params.stop[0]"),
    ],
)
def test_lone_surrogate_is_a_400_naming_its_path(server, path, body, param):
    """A lone surrogate ("\\udc80") in chat content was a 500 with two tracebacks (the
    tokenizer's TypeError), elsewhere a 400 without a param; now a 400 naming where it is."""
    err = _assert_openai_error(_send(server, path, _raw(body)), 400, "lone UTF-16 surrogate")
    assert err["param"] == param and err["message"].startswith(param)
    _healthy(server)


@pytest.mark.parametrize(
    "path,body,param",
    [
        (GEN, {"text": "hi", "return_logprob": "yes"}, "return_logprob"),
        (GEN, {"text": ["a", "b"], "return_logprob": [True, 1]}, "return_logprob"),
        (GEN, {"text": "hi", "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
        (CHAT, chat(stream="yes"), "stream"),
        (CHAT, chat(logprobs=1), "logprobs"),
        (COMP, comp(echo="true"), "echo"),
        (COMP, comp(ignore_eos=0), "ignore_eos"),
        (COMP, comp(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
    ],
)
def test_boolean_fields_take_json_booleans_only(server, path, body, param):
    """OpenAI (and the fork's integer fields) refuse other JSON types for a boolean; "yes" was
    taken as true."""
    err = _assert_openai_error(_send(server, path, body), 400, param)
    assert err["param"] is not None and err["param"].startswith(param)
    _healthy(server)


def test_stream_options_need_stream_and_messages_need_content(server):
    """As upstream and OpenAI: stream_options without stream is a 400; a non-assistant
    message without content is a 400 (an assistant message may omit it)."""
    for path, body in (
        (COMP, comp(stream_options={"include_usage": True})),
        (CHAT, chat(stream_options={"include_usage": True})),
    ):
        _assert_openai_error(_send(server, path, body), 400, "'stream_options' is only allowed")
    for role in ("user", "system"):
        msgs = [{"role": role}] + ([{"role": "user", "content": "hi"}] if role == "system" else [])
        err = _assert_openai_error(_send(server, CHAT, chat(messages=msgs)), 400, "'content'")
        assert err["param"].startswith("messages[0]")
    ok = [
        {"role": "user", "content": "hi"},
        {"role": "assistant"},
        {"role": "user", "content": "x"},
    ]
    _served(_send(server, CHAT, chat(messages=ok)))
    _healthy(server)


def test_null_n_means_one_on_the_openai_routes(server):
    """OpenAI's n is nullable (null = 1): one choice, not a 400."""
    for path, body in ((CHAT, chat(n=None)), (COMP, comp(n=None))):
        r = _send(server, path, body)
        _served(r)
        assert len(r.json()["choices"]) == 1
