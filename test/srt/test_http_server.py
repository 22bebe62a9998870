"""Native HTTP endpoints of `python -m sglang.launch_server`, against a live server subprocess
running a tiny random-weight Llama on CPU: /generate (text, ids, batch, stream, logprobs),
info endpoints, metrics, 64 concurrent streams, client disconnect, abort, SIGTERM shutdown.

`ServerProcess` is also used by test_openai_server.py, test_http_errors.py and
test_bench_serving.py (one server per module)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp
import psutil
import pytest
import requests
import torch

READY = "The server is fired up and ready to roll!"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m sglang.launch_server` in a subprocess; waits for the ready line."""

    def __init__(self, model_path: str, *extra: str, api_key: str | None = None) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_path,
            "--port",
            str(self.port),
            "--device",
            "cpu",
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_ready(timeout_s=180)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if READY in self.log_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        text = self.log_text()
        self.stop()
        raise RuntimeError(f"server did not start:\n{text[-4000:]}")

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.base_url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, body: dict, **kw) -> requests.Response:
        return requests.post(
            self.base_url + path, json=body, headers=self.headers, timeout=60, **kw
        )

    def internal_state(self) -> dict:
        return self.get("/get_server_info").json()["internal_states"][0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        os.unlink(self.log.name)


def sse_events(resp: requests.Response, lines=None) -> list:
    """Payloads of a `data:` stream; the final [DONE] is kept as the string "[DONE]"."""
    out = []
    for line in lines if lines is not None else resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def greedy(n: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--enable-metrics")
    yield srv
    srv.stop()


# ---- basic endpoints ---------------------------------------------------------------------------
def test_info_endpoints(server, tiny_model_dir):
    assert server.get("/health").status_code == 200
    info = server.get("/get_model_info").json()
    assert info["model_path"] == tiny_model_dir and info["is_generation"] is True
    assert info["tokenizer_path"] == tiny_model_dir
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [info["served_model_name"]]
    # OpenAI's retrieve route, by name, by path (slashes included) and by "default"
    for name in (info["served_model_name"], tiny_model_dir, "default"):
        card = server.get(f"/v1/models/{name}").json()
        assert card == {**models["data"][0], "created": card["created"]}
    missing = server.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    state = server.internal_state()
    assert state["kv_pool_size"] > 0 and state["num_running_reqs"] == 0
    # the garbage-collector counters start after freeze_gc: its full collection over the
    # start-up objects (~0.2 s for SmolLM2) is not a pause while serving
    assert state["gc_collections_gen2"] == 0 and state["gc_s_gen2"] == 0.0
    # ServerProcess serves with --device cpu, also on a GPU machine: the CPU defaults
    assert state["attention_backend"] == "torch_native"
    assert state["overlap_schedule"] is False and state["cuda_graph_bs"] == []
    # a CPU scheduler keeps its CPU thread pools (on CUDA it runs one thread per pool:
    # test_process_env.py; the H200 sweeps' server_state shows cpu_threads 1)
    assert state["cpu_threads"] == torch.get_num_threads()
    assert server.get("/health_generate").status_code == 200
    assert server.get("/flush_cache").status_code == 200
    assert server.post("/flush_cache", {}).status_code == 200


def test_generate_text_ids_batch_and_stream(server):
    out = server.post(
        "/generate", {"text": "The capital of France is", "sampling_params": greedy(6)}
    ).json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert meta["finish_reason"]["type"] == "length"
    ids = server.post("/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": greedy(6)})
    batch = server.post(
        "/generate", {"text": ["The capital of France is", "Hello"], "sampling_params": greedy(6)}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == out["output_ids"]
    hello = server.post("/generate", {"text": "Hello", "sampling_params": greedy(6)}).json()
    assert batch[1]["output_ids"] == hello["output_ids"]
    assert ids.json()["meta_info"]["prompt_tokens"] == 4
    r = server.post(
        "/generate",
        {"text": "The capital of France is", "stream": True, "sampling_params": greedy(6)},
        stream=True,
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["output_ids"] == out["output_ids"] and chunks[-1]["text"] == out["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_logprobs(server):
    out = server.post(
        "/generate",
        {
            "text": "One two three",
            "sampling_params": greedy(5),
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    ).json()
    meta = out["meta_info"]
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert [t[1] for t in lps] == out["output_ids"]
    assert len(tops) == 5 and all(len(row) == 3 for row in tops)
    for (lp, tid, _), row in zip(lps, tops, strict=True):
        assert row[0][1] == tid and row[0][0] == pytest.approx(lp)  # greedy = top-1
        assert row[0][0] >= row[1][0] >= row[2][0]
    assert all(t[2] is None for t in lps)  # token texts only on request


def test_generate_logprobs_with_text(server, tiny_model_dir):
    """return_text_in_logprobs fills each entry's third field with the token's text, as
    upstream (it was accepted and ignored: every text was null)."""
    from sglang.srt.utils.tokenizer import get_tokenizer

    body = {
        "text": "One two three",
        "sampling_params": greedy(4),
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    meta = server.post("/generate", body).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    tops = [row for row in meta["input_top_logprobs"] + meta["output_top_logprobs"] if row]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"] + sum(tops, [])
    tok = get_tokenizer(tiny_model_dir, None)
    for _lp, tid, text in entries:
        assert text == tok.decode([tid])


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_metrics_count_exactly(server):
    names = [
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:time_to_first_token_seconds_count",
    ]
    before = server.get("/metrics").text
    out = server.post(
        "/generate", {"text": "count these tokens please", "sampling_params": greedy(7)}
    ).json()
    after = server.get("/metrics").text
    delta = {n: _metric(after, n) - _metric(before, n) for n in names}
    assert delta == {
        "sglang:prompt_tokens_total": out["meta_info"]["prompt_tokens"],
        "sglang:generation_tokens_total": 7,
        "sglang:num_requests_total": 1,
        "sglang:e2e_request_latency_seconds_count": 1,
        "sglang:time_to_first_token_seconds_count": 1,
    }
    state = server.internal_state()
    assert _metric(after, "sglang:num_running_reqs") == 0
    # Idle: the finished request's KV is evictable prefix cache, which is not "used" (upstream)
    assert state["kv_evictable_tokens"] > 0
    assert state["num_used_tokens"] == 0 == state["token_usage"]
    assert state["num_used_tokens"] == (
        state["kv_pool_size"] - state["kv_available_tokens"] - state["kv_evictable_tokens"]
    )
    text = server.get("/metrics").text
    assert _metric(text, "sglang:num_used_tokens") == 0 == _metric(text, "sglang:token_usage")


@pytest.mark.parametrize("stream", [False, True])
def test_latency_histograms(server, stream):
    """TTFT is the first token's time, not the end-to-end latency (a non-streamed request's
    only delivery is at its end), and TPOT = (e2e - TTFT) / (7 - 1) is positive."""
    hists = ("time_to_first_token", "time_per_output_token", "e2e_request_latency")
    names = [f"sglang:{h}_seconds_{s}" for h in hists for s in ("count", "sum")]
    before = server.get("/metrics").text
    body = {"text": "time these tokens please", "sampling_params": greedy(7), "stream": stream}
    r = server.post("/generate", body, stream=stream)
    assert (sse_events(r)[-2] if stream else r.json())["meta_info"]["completion_tokens"] == 7
    after = server.get("/metrics").text
    d = {n.split(":")[1]: _metric(after, n) - _metric(before, n) for n in names}
    assert [d[f"{h}_seconds_count"] for h in hists] == [1, 1, 1]
    ttft, tpot = d["time_to_first_token_seconds_sum"], d["time_per_output_token_seconds_sum"]
    e2e = d["e2e_request_latency_seconds_sum"]
    assert 0 < ttft < e2e and tpot > 0
    assert ttft + 6 * tpot == pytest.approx(e2e, rel=1e-6)


# ---- concurrency and cancellation --------------------------------------------------------------
async def _stream_text(session: aiohttp.ClientSession, url: str, prompt: str) -> list[int]:
    body = {"text": prompt, "stream": True, "sampling_params": greedy(6)}
    last = None
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                last = json.loads(line[6:])
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    return last["output_ids"]


@pytest.mark.slow
def test_64_concurrent_streams_match_solo(server):
    prompts = [f"Request {i}: write about topic number {i * 7 % 13}" for i in range(64)]

    async def run_all() -> list[list[int]]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[_stream_text(s, server.base_url, p) for p in prompts])

    together = asyncio.run(run_all())
    alone = [
        server.post("/generate", {"text": p, "sampling_params": greedy(6)}).json() for p in prompts
    ]
    assert together == [a["output_ids"] for a in alone]
    assert server.internal_state()["num_running_reqs"] == 0


def _wait_idle_and_no_leak(server: ServerProcess, timeout_s: float) -> tuple[float, dict]:
    start = time.time()
    while True:
        s = server.internal_state()
        held = s["radix_cache_tokens"]
        if s["num_running_reqs"] == 0 and s["kv_available_tokens"] + held == s["kv_pool_size"]:
            return time.time() - start, s
        if time.time() - start > timeout_s:
            raise AssertionError(f"KV not freed after {timeout_s}s: {s}")
        time.sleep(0.05)


def _open_long_stream(server: ServerProcess, rid: str):
    """Start a 2000-token stream, read 6 frames; return (response, line iterator, s/token)."""
    body = {
        "text": "Tell me a very long story.",
        "stream": True,
        "rid": rid,
        "sampling_params": greedy(2000),
    }
    start = time.time()
    resp = requests.post(server.base_url + "/generate", json=body, stream=True, timeout=60)
    lines = resp.iter_lines()
    frames, last = 0, None
    while frames < 6:
        line = next(lines)
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            frames, last = frames + 1, json.loads(line[6:])
    # Seconds per token over the whole request so far (prefill included, so an overestimate):
    # frames can arrive in bursts on a loaded machine, so their spacing alone says nothing.
    return resp, lines, (time.time() - start) / max(1, len(last["output_ids"]))


def test_client_disconnect_frees_kv(server):
    before = server.get("/metrics").text
    resp, _, per_token = _open_long_stream(server, "disconnect-me")
    state = server.internal_state()
    assert state["num_running_reqs"] == 1
    resp.close()  # the client goes away mid-stream
    remaining_s = (2000 - 6) * per_token  # how long the request would still run
    freed_after, _ = _wait_idle_and_no_leak(server, timeout_s=min(5.0, remaining_s / 2))
    assert freed_after < remaining_s / 2
    # The request and the tokens it was sent are counted (they were not, unlike a request
    # aborted through /abort_request)
    after = server.get("/metrics").text
    names = ("sglang:num_requests_total", "sglang:generation_tokens_total")
    requests_, tokens = (_metric(after, n) - _metric(before, n) for n in names)
    assert requests_ == 1 and 6 <= tokens < 2000


def test_abort_request_endpoint(server):
    resp, lines, per_token = _open_long_stream(server, "abort-me")
    assert server.post("/abort_request", {"rid": "abort-me"}).status_code == 200
    start = time.time()
    events = sse_events(resp, lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-2]["output_ids"]) < 2000
    assert time.time() - start < max(2.0, (2000 - 6) * per_token / 2)
    _wait_idle_and_no_leak(server, timeout_s=5.0)


def test_abort_all_ends_every_request_in_flight(server):
    """{"abort_all": true} (upstream's AbortReq field) aborts every running request; bad
    bodies get a 400 that names the field, and the server keeps serving."""
    streams = [_open_long_stream(server, f"all-{i}") for i in range(2)]
    assert server.internal_state()["num_running_reqs"] == 2
    assert server.post("/abort_request", {"abort_all": True}).status_code == 200
    for resp, lines, _ in streams:
        events = sse_events(resp, lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(events[-2]["output_ids"]) < 2000
    _wait_idle_and_no_leak(server, timeout_s=5.0)
    bad = server.post("/abort_request", {"abort_all": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "abort_all"
    bad = server.post("/abort_request", {"abort_all": False})
    assert bad.status_code == 400 and "abort_all" in bad.json()["error"]["message"]
    out = server.post("/generate", {"text": "Hi", "sampling_params": greedy(4)}).json()
    assert len(out["output_ids"]) == 4


# ---- shutdown -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_stops_every_process(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir)
    try:
        main = psutil.Process(srv.proc.pid)
        family = [main, *main.children(recursive=True)]
        assert len(family) >= 2  # the server and at least the scheduler
        # a client is mid-stream while the server is told to stop
        events: list = []
        stream = threading.Thread(target=lambda: _stream_until_cut(srv, events), daemon=True)
        stream.start()
        deadline = time.time() + 30
        while len(events) < 3 and time.time() < deadline:  # the stream is under way
            time.sleep(0.05)
        assert len(events) >= 3
        log_before = srv.log_text()
        start = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(10)
        gone_at = time.time() - start
        # by design at most ~5 s (uvicorn's 2 s graceful shutdown, then up to 3 s for the children
        # before SIGKILL); the bound leaves room for a loaded 2-core CI machine (5.04 s seen there)
        _, alive = psutil.wait_procs(family, timeout=max(0.1, 10.0 - gone_at))
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [] and gone_at < 10.0
        # the stream was ended, not cut: its last chunk says abort (why), then [DONE]
        stream.join(10)
        assert events[-1] == "[DONE]", events[-3:]
        reason = events[-2]["meta_info"]["finish_reason"]
        assert reason == {"type": "abort", "message": "the server is shutting down"}, [
            (e if e == "[DONE]" else (e["meta_info"]["finish_reason"], len(e["output_ids"])))
            for e in events[-4:]
        ]
        log = srv.log_text()[len(log_before) :]
        assert "ended 1 request(s) in flight" in log
        assert "graceful shutdown exceeded" not in log and "Traceback" not in log
    finally:  # a failed assertion must not leave the server running
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(5)
        os.unlink(srv.log.name)


def test_engine_shutdown_is_clean(tiny_model_dir):
    """Engine.shutdown SIGTERMs the scheduler, which exits through SystemExit: no traceback
    and no 'leaked semaphore' report from the parent's resource tracker at exit."""
    script = (
        "import sglang\n"
        "if __name__ == '__main__':\n"
        f"    with sglang.Engine(model_path={tiny_model_dir!r}) as e:\n"
        "        print(len(e.generate('hi', {'max_new_tokens': 2})['output_ids']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "2"
    assert "leaked semaphore" not in out.stderr and "Traceback" not in out.stderr


def _stream_until_cut(srv: ServerProcess, events: list) -> None:
    """Stream a long /generate into `events` (sse_events' form) until the server ends it."""
    body = {"text": "Go on forever", "stream": True, "sampling_params": greedy(2000)}
    try:
        with requests.post(srv.base_url + "/generate", json=body, stream=True, timeout=30) as r:
            for line in r.iter_lines():
                events.extend(sse_events(r, [line]))
    except requests.RequestException:
        pass
