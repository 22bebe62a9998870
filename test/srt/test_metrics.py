"""Metric definitions: KV accounting of the scheduler's internal state and the Prometheus gauges
fed from it (upstream SGLang's num_used_tokens / token_usage); the request-latency histograms
(TTFT from the scheduler's first-token stamp, TPOT = (e2e - TTFT) / (tokens - 1), ITL gaps)."""

from __future__ import annotations

import time

import pytest

from sglang.srt.managers import tokenizer_manager
from sglang.srt.managers.io_struct import BatchStrOut
from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager
from sglang.srt.metrics.collector import TokenizerMetricsCollector
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

LABELS = {"model_name": "m"}
PROMPT = list(range(100, 123))  # 23 tokens
GREEDY = {"temperature": 0, "ignore_eos": True}


def _sample(c: TokenizerMetricsCollector, name: str) -> float | None:
    return c.registry.get_sample_value(name, LABELS)


@pytest.fixture
def sched(tiny_model_dir):
    return make_scheduler(tiny_model_dir, disable_overlap_schedule=True)


def test_evictable_prefix_cache_is_not_used(sched):
    """After a request finishes its KV stays in the radix cache, evictable: 0 tokens are used,
    by num_used_tokens as by token_usage (before: num_used_tokens counted the cache)."""
    outs: dict = {}
    submit(sched, "a", PROMPT, {**GREEDY, "max_new_tokens": 5})
    run_until_idle(sched, outs)
    state = sched.internal_state()
    # the prompt and 4 of the 5 outputs have KV (the last sampled token is never fed back)
    assert state["radix_cache_tokens"] == state["kv_evictable_tokens"] == 23 + 4
    assert state["kv_available_tokens"] == state["kv_pool_size"] - 27
    assert state["num_used_tokens"] == 0 and state["token_usage"] == 0.0
    c = TokenizerMetricsCollector(LABELS)
    c.set_internal_state(state)
    assert _sample(c, "sglang:num_used_tokens") == 0
    assert _sample(c, "sglang:token_usage") == 0.0


def test_running_request_slots_are_used(sched):
    """Mid-request: num_used_tokens is exactly the slots the request holds, token_usage is
    that over the pool, and both gauges report the same numbers."""
    submit(sched, "a", PROMPT, {**GREEDY, "max_new_tokens": 50})
    sched.step()  # prefill: 23 prompt slots
    sched.step()  # one decode step: the first output token's slot
    sched.step()  # and the second's
    state = sched.internal_state()
    pool = state["kv_pool_size"]
    assert state["num_running_reqs"] == 1
    assert state["num_used_tokens"] == 23 + 2
    assert state["token_usage"] == 25 / pool
    assert state["kv_available_tokens"] + state["kv_evictable_tokens"] == pool - 25
    c = TokenizerMetricsCollector(LABELS)
    c.set_internal_state(state)
    assert _sample(c, "sglang:num_used_tokens") == 25
    assert _sample(c, "sglang:token_usage") == pytest.approx(25 / pool, rel=1e-12)


# ---- time to first token and time per output token -------------------------------------------
def test_scheduler_stamps_the_first_token_of_a_non_streamed_request(sched):
    """The only message of a non-streamed request arrives when it finishes; it carries the
    time the first token was committed (during the prefill step), not the finish time."""
    submit(sched, "a", PROMPT, {**GREEDY, "max_new_tokens": 4})
    t0 = time.perf_counter()
    sched.step()  # prefill: samples the first token
    t1 = time.perf_counter()
    assert sched.outputs.local_outbox == []  # not streamed: nothing sent yet
    for _ in range(3):
        sched.step()
    (msg,) = sched.outputs.local_outbox
    assert isinstance(msg, BatchStrOut) and msg.rids == ["a"]
    assert len(msg.output_ids_delta[0]) == 4 and msg.finished_reason[0]["type"] == "length"
    assert t0 < msg.first_token_time[0] < t1


def test_scheduler_stamp_is_kept_in_every_streamed_message(sched):
    submit(sched, "a", PROMPT, {**GREEDY, "max_new_tokens": 3}, stream=True)
    msgs = []
    while not sched.is_idle():
        sched.step()
        msgs += sched.outputs.local_outbox
        sched.outputs.local_outbox.clear()
    stamps = [m.first_token_time[0] for m in msgs]
    assert len(stamps) == 3 and stamps[0] is not None and stamps == [stamps[0]] * 3


class _Clock:
    """time.perf_counter for the tokenizer manager: returns the values it is set to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _manager(collector: TokenizerMetricsCollector, state: ReqState) -> TokenizerManager:
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state = {state.rid: state}
    tm.metrics_collector = collector
    return tm


def _out(ids: list[int], first: float, done: bool) -> BatchStrOut:
    reason = {"type": "length", "matched": None} if done else None
    return BatchStrOut(["r"], [""], [ids], [reason], [{}], first_token_time=[first])


HISTOGRAMS = {
    "time_to_first_token": "sglang:time_to_first_token_seconds",
    "time_per_output_token": "sglang:time_per_output_token_seconds",
    "inter_token_latency": "sglang:inter_token_latency_seconds",
    "e2e_request": "sglang:e2e_request_latency_seconds",
}


def _histograms(c: TokenizerMetricsCollector) -> dict[str, tuple[float, float]]:
    """Short name -> (count, sum) of each latency histogram."""
    return {
        k: (_sample(c, name + "_count"), _sample(c, name + "_sum"))
        for k, name in HISTOGRAMS.items()
    }


def test_non_streamed_request_ttft_and_tpot(monkeypatch):
    """Created at 100.0, first token committed at 100.1, the one (final) message with 5 tokens
    received at 100.5: TTFT 0.1 (was 0.5, the e2e latency), TPOT (0.5 - 0.1) / 4 (was 0)."""
    clock = _Clock()
    monkeypatch.setattr(tokenizer_manager.time, "perf_counter", clock)
    c = TokenizerMetricsCollector(LABELS)
    state = ReqState(rid="r", prompt_tokens=7, return_logprob=False, created=100.0)
    clock.now = 100.5
    _manager(c, state)._handle_batch_out(_out([5, 6, 7, 8, 9], first=100.1, done=True))
    h = _histograms(c)
    assert h["time_to_first_token"] == (1, pytest.approx(0.1, abs=1e-9))
    assert h["e2e_request"] == (1, pytest.approx(0.5, abs=1e-9))
    assert h["time_per_output_token"] == (1, pytest.approx(0.1, abs=1e-9))
    assert h["inter_token_latency"] == (0, 0)  # one delivery: no gap between deliveries


def test_streamed_request_ttft_itl_and_tpot(monkeypatch):
    """Three one-token deliveries received at 100.2, 100.3, 100.45 (first token committed at
    100.1): TTFT 0.1, ITL gaps 0.1 and 0.15, TPOT (0.45 - 0.1) / 2."""
    clock = _Clock()
    monkeypatch.setattr(tokenizer_manager.time, "perf_counter", clock)
    c = TokenizerMetricsCollector(LABELS)
    state = ReqState(rid="r", prompt_tokens=7, return_logprob=False, created=100.0)
    tm = _manager(c, state)
    for now, tok, done in ((100.2, 5, False), (100.3, 6, False), (100.45, 7, True)):
        clock.now = now
        tm._handle_batch_out(_out([tok], first=100.1, done=done))
    h = _histograms(c)
    assert h["time_to_first_token"] == (1, pytest.approx(0.1, abs=1e-9))
    assert h["inter_token_latency"] == (2, pytest.approx(0.25, abs=1e-9))
    assert h["time_per_output_token"] == (1, pytest.approx(0.175, abs=1e-9))
    assert h["e2e_request"] == (1, pytest.approx(0.45, abs=1e-9))


def test_itl_is_per_token_when_a_delivery_carries_several(monkeypatch):
    """A speculative step delivers several tokens at once: deliveries of 1, 3 and 2 tokens at
    100.2, 100.5, 100.6 give ITL entries 0.1 x 3 and 0.05 x 2 (upstream divides each gap over
    the delivery's tokens), so count = tokens - 1 = 5 and sum = 0.4 = last - first delivery."""
    clock = _Clock()
    monkeypatch.setattr(tokenizer_manager.time, "perf_counter", clock)
    c = TokenizerMetricsCollector(LABELS)
    state = ReqState(rid="r", prompt_tokens=7, return_logprob=False, created=100.0)
    tm = _manager(c, state)
    for now, toks, done in ((100.2, [5], False), (100.5, [6, 7, 8], False), (100.6, [9, 10], True)):
        clock.now = now
        tm._handle_batch_out(_out(toks, first=100.1, done=done))
    h = _histograms(c)
    assert h["inter_token_latency"] == (5, pytest.approx(0.4, abs=1e-9))
    bucket = HISTOGRAMS["inter_token_latency"] + "_bucket"
    assert c.registry.get_sample_value(bucket, {**LABELS, "le": "0.06"}) == 2  # the 0.05 s
    assert c.registry.get_sample_value(bucket, {**LABELS, "le": "0.1"}) == 5
    assert h["time_per_output_token"] == (1, pytest.approx(0.5 / 5, abs=1e-9))


def test_request_without_output_tokens_has_no_ttft(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(tokenizer_manager.time, "perf_counter", clock)
    c = TokenizerMetricsCollector(LABELS)
    state = ReqState(rid="r", prompt_tokens=7, return_logprob=False, created=100.0)
    clock.now = 100.3
    _manager(c, state)._handle_batch_out(_out([], first=None, done=True))
    h = _histograms(c)
    assert h["time_to_first_token"] == (0, 0) and h["time_per_output_token"] == (0, 0)
    assert h["e2e_request"] == (1, pytest.approx(0.3, abs=1e-9))
