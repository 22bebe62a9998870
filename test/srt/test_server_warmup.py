"""The HTTP server's warm-up: one /generate request carrying a batch of two prompts, which the
scheduler prefills as one batch of two (on CUDA a lone prompt would replay a prefill graph and
leave the eager multi-request prefill's kernels to compile at the first concurrent burst)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from sglang.srt.entrypoints import http_server
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit


class _Reply:
    def raise_for_status(self) -> None:
        pass


def test_warmup_sends_one_request_with_two_prompts(monkeypatch):
    sent = []

    def post(url, json, headers, timeout):
        sent.append((url, json, headers))
        return _Reply()

    monkeypatch.setattr(http_server.requests, "post", post)
    server = SimpleNamespace(started=True, should_exit=False)
    failed = threading.Event()
    sa = ServerArgs(host="0.0.0.0", port=31000, api_key="k")
    http_server._warmup(sa, server, failed)
    assert not failed.is_set() and not server.should_exit
    [(url, body, headers)] = sent
    assert url == "http://127.0.0.1:31000/generate"
    assert headers == {"Authorization": "Bearer k"}
    assert body["text"] == http_server.WARMUP_PROMPTS
    assert len(set(body["text"])) == 2  # distinct: no prefix hit shortens the second
    sent.clear()
    http_server._warmup(ServerArgs(port=31000, skip_server_warmup=True), server, failed)
    assert sent == []


def test_two_prompts_that_arrive_together_prefill_as_one_batch(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, device="cpu", dtype="float32")
    params = {"temperature": 0, "max_new_tokens": 8}
    submit(sched, "w0", list(range(10, 17)), params)
    submit(sched, "w1", list(range(30, 41)), params)
    batch = sched.step()
    assert batch.forward_mode == ForwardMode.EXTEND and len(batch.reqs) == 2
    outs: dict = {}
    run_until_idle(sched, outs)
    assert sorted(outs) == ["w0", "w1"]
