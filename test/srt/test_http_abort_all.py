"""/abort_request {"abort_all": true} (review): n > 1 and batch requests (several rids per HTTP
request), requests still waiting in the scheduler's queue, streaming and non-streaming, the
OpenAI route too; the error bodies of bad input."""

from __future__ import annotations

import threading
import time

import requests
from test_http_server import ServerProcess, _wait_idle_and_no_leak, greedy, sse_events


def test_abort_all_batches_n_queue_stream_and_not(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--max-running-requests", "2")
    try:
        results: dict = {}

        def call(name, path, body, stream=False):
            r = requests.post(srv.base_url + path, json=body, stream=stream, timeout=120)
            results[name] = (r.status_code, sse_events(r) if stream else r.json())

        long = greedy(2000)
        jobs = [
            (
                "batch_n2",
                "/generate",
                {"text": ["Hi", "Tell"], "sampling_params": {**long, "n": 2}},
            ),
            (
                "stream",
                "/generate",
                {"text": "Go on", "stream": True, "sampling_params": long},
                True,
            ),
            ("single", "/generate", {"text": "Once", "sampling_params": long}),
            (
                "openai",
                "/v1/completions",
                {"model": "default", "prompt": "x", "max_tokens": 2000, "n": 2, "stream": True},
                True,
            ),
        ]
        threads = [threading.Thread(target=call, args=j) for j in jobs]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        seen = []
        while True:  # 8 requests: 2 running, the rest waiting in the queue
            s = srv.internal_state()
            seen.append((s["num_running_reqs"], s["num_waiting_reqs"]))
            if s["num_running_reqs"] + s["num_waiting_reqs"] == 8 and s["num_running_reqs"] == 2:
                break
            assert time.time() < deadline, sorted(set(seen))
            time.sleep(0.05)
        assert s["num_waiting_reqs"] == 6
        assert srv.post("/abort_request", {"abort_all": True}).status_code == 200
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        code, outs = results["batch_n2"]
        assert code == 200 and len(outs) == 4
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        code, out = results["single"]
        assert code == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        code, ev = results["stream"]
        assert ev[-1] == "[DONE]" and ev[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        code, ev = results["openai"]
        assert code == 200 and ev[-1] == "[DONE]"
        reasons = [c["finish_reason"] for e in ev[:-1] for c in e["choices"] if c["finish_reason"]]
        assert len(reasons) == 2, ev[-3:]
        _wait_idle_and_no_leak(srv, timeout_s=10.0)
        assert srv.internal_state()["num_waiting_reqs"] == 0
        # bad input: OpenAI error bodies
        for body, param in (
            ({"abort_all": "yes"}, "abort_all"),
            ({"abort_all": 1}, "abort_all"),
            ({"abort_all": False}, "rid"),
            ({}, "rid"),
            ([1], None),
        ):
            r = srv.post("/abort_request", body)
            err = r.json()["error"]
            assert r.status_code == 400, body
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        r = requests.post(srv.base_url + "/abort_request", data=b"{", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        # nothing in flight: still 200
        assert srv.post("/abort_request", {"abort_all": True}).status_code == 200
        out = srv.post("/generate", {"text": "Hi", "sampling_params": greedy(4)}).json()
        assert len(out["output_ids"]) == 4
    finally:
        srv.stop()
