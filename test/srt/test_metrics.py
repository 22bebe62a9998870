"""Metric definitions: KV accounting of the scheduler's internal state and the Prometheus gauges
fed from it (upstream SGLang's num_used_tokens / token_usage)."""

from __future__ import annotations

import pytest

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
