"""ModelRunner.profile_max_num_tokens: --max-total-tokens is capped at what fits in
--mem-fraction-static of the GPU (upstream's behaviour), with the GPU's free memory faked so
that the arithmetic runs on the CPU machine."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.model_runner import ModelRunner

GIB = 2**30


def runner(device: str, max_total_tokens=None, mem_fraction_static=None) -> ModelRunner:
    r = object.__new__(ModelRunner)  # only the fields profile_max_num_tokens reads
    r.device = torch.device(device)
    r.dtype = torch.bfloat16
    r.model_config = SimpleNamespace(
        num_key_value_heads=8, head_dim=128, num_hidden_layers=32, hidden_size=4096
    )
    r.server_args = SimpleNamespace(
        max_total_tokens=max_total_tokens,
        mem_fraction_static=mem_fraction_static,
        speculative_algorithm=None,
    )
    return r


@pytest.fixture
def fake_gpu(monkeypatch):
    """80 GiB card with 63 GiB free after the weights."""
    monkeypatch.delenv("SGLANG_MAX_TOTAL_TOKENS_DEFAULT", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (63 * GIB, 80 * GIB))


def per_token() -> int:
    return MHATokenToKVPool.bytes_per_token(torch.bfloat16, 8, 128, 32)


def test_requested_tokens_that_fit_are_kept(fake_gpu):
    assert per_token() == 131072  # Llama-3.1-8B: 32 layers x 8 heads x 128 x (K, V) x 2 bytes
    assert runner("cuda", 200_000).profile_max_num_tokens() == 200_000


def test_requested_tokens_beyond_the_memory_are_capped_with_a_warning(fake_gpu, caplog):
    fit = int((63 * GIB - 80 * GIB * (1 - 0.85)) // per_token())
    assert fit == 51 * 8192  # 63 - 12 GiB left, 128 KiB a token
    with caplog.at_level(logging.WARNING):
        got = runner("cuda", 500_000).profile_max_num_tokens()
    assert got == fit
    assert "--max-total-tokens 500000 does not fit" in caplog.text
    assert runner("cuda", None).profile_max_num_tokens() == fit  # unset: the fit itself
    low = int((63 * GIB - 80 * GIB * (1 - 0.80)) // per_token())
    assert runner("cuda", 500_000, 0.80).profile_max_num_tokens() == low


def test_no_room_is_an_error_that_names_the_flags(fake_gpu):
    with pytest.raises(RuntimeError, match="--mem-fraction-static 0.2 leaves room for 0"):
        runner("cuda", 1000, 0.2).profile_max_num_tokens()
    # a fit under 128 slots still serves a request that fits in it
    tiny = int((63 * GIB - 80 * GIB * (1 - 0.2126)) // per_token())
    assert 0 < tiny < 128
    assert runner("cuda", tiny, 0.2126).profile_max_num_tokens() == tiny
    with pytest.raises(RuntimeError, match=f"leaves room for {tiny} tokens"):
        runner("cuda", None, 0.2126).profile_max_num_tokens()


def test_the_test_suites_default_is_taken_as_given(fake_gpu, monkeypatch):
    """SGLANG_MAX_TOTAL_TOKENS_DEFAULT lets many engines share one GPU: the fraction of the
    whole card says nothing there, so it is not capped (it would be: 0.2 leaves room for 0)."""
    monkeypatch.setenv("SGLANG_MAX_TOTAL_TOKENS_DEFAULT", "65536")
    assert runner("cuda", None, 0.2).profile_max_num_tokens() == 65536
    assert runner("cpu", None).profile_max_num_tokens() == 65536
    assert runner("cuda", 1000).profile_max_num_tokens() == 1000  # the flag wins


def test_cpu_takes_the_request_as_given(monkeypatch):
    monkeypatch.delenv("SGLANG_MAX_TOTAL_TOKENS_DEFAULT", raising=False)
    assert runner("cpu", 123_456).profile_max_num_tokens() == 123_456
    # unset: what fits in 1 GiB, at most 65536 (128 KiB a token here: 8192)
    assert runner("cpu", None).profile_max_num_tokens() == 8192
