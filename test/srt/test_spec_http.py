"""Speculative decoding through the HTTP server: per-request max_draft_tokens (native and
OpenAI extra_body), speculative meta_info, /get_server_info and /metrics reporting."""

from __future__ import annotations

import openai
import pytest
from test_http_server import ServerProcess, greedy

from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    draft = make_tiny_eagle3_dir(str(tmp_path_factory.mktemp("eagle3_http")), tiny_model_dir)
    spec = ServerProcess(
        tiny_model_dir,
        "--enable-metrics",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        "3",
    )
    yield spec
    spec.stop()


def test_spec_meta_info_and_caps(servers):
    body = {"text": ["Hello there", "A B C"], "sampling_params": [greedy(12), greedy(12)]}
    body["sampling_params"][1]["max_draft_tokens"] = 0
    outs = servers.post("/generate", body).json()
    on, off = outs[0]["meta_info"], outs[1]["meta_info"]
    for m in (on, off):
        assert m["completion_tokens"] == 12
        assert m["spec_verify_ct"] == 11 - sum(
            k * n for k, n in enumerate(m["spec_accept_histogram"])
        )
        assert m["spec_accept_length"] == pytest.approx(12 / m["spec_verify_ct"])
    assert on["spec_num_proposed_drafts"] > 0
    assert off["spec_num_proposed_drafts"] == 0 and sum(off["spec_accept_histogram"]) == 0


def test_openai_extra_body_max_draft_tokens(servers):
    client = openai.OpenAI(base_url=servers.base_url + "/v1", api_key="none")
    a = client.completions.create(
        model="default",
        prompt="Once upon",
        max_tokens=10,
        temperature=0,
        extra_body={"max_draft_tokens": 0, "ignore_eos": True},
    )
    b = client.completions.create(
        model="default",
        prompt="Once upon",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 10
    bad = servers.post("/generate", {"text": "x", "sampling_params": {"max_draft_tokens": -1}})
    assert bad.status_code == 400 and "max_draft_tokens" in bad.json()["error"]["message"]


def test_server_info_and_metrics(servers):
    servers.post("/generate", {"text": "metrics", "sampling_params": greedy(6)})
    state = servers.internal_state()
    assert state["avg_spec_accept_length"] >= 1.0
    assert len(state["spec_accept_histogram"]) == 4
    text = servers.get("/metrics").text
    assert "sglang:spec_accept_length_per_request_bucket" in text
    assert "sglang:spec_share_requests_drafting" in text
    assert "sglang:spec_mean_draft_len" in text
    # the per-request histogram counted the finished requests (at least the one above)
    count = [
        ln
        for ln in text.splitlines()
        if ln.startswith("sglang:spec_mean_draft_len_per_request_count")
    ]
    assert len(count) == 1 and float(count[0].split()[-1]) >= 1
