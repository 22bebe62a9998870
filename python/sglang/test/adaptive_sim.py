"""Synthetic pieces for the adaptive speculation tests (issue 7), shared by the
test/srt/test_adaptive_*.py files and test_deferred_draft_extend.py: the maximum draft length
K they use, step-time models with chosen coefficients, and running requests as the adaptive
controller reads them."""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.speculative.adaptive.step_time_model import FEATURES, StepTimeModel

K = 4
"""The maximum draft length (--speculative-num-steps) of the synthetic views and controllers."""

ZERO = dict.fromkeys(FEATURES, 0.0)
"""Every step-time feature's coefficient at 0 (a base to set a few of them on)."""


def synthetic(**coef: float) -> StepTimeModel:
    """A fixed step-time model (no online correction): the given coefficients, 0 elsewhere."""
    return StepTimeModel({**ZERO, **coef}, online=False)


# Step time dominated by the fixed cost of a forward (one request, memory-bound).
LIGHT = synthetic(const=1e-2, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4, spec_on=3e-4)


def pending_req(slot: int, kv_len: int = 10) -> SimpleNamespace:
    """A running request as the controller reads it (duck-typed), one position pending."""
    draft = SimpleNamespace(draft_kv_len=kv_len - 1, stale=False)
    return SimpleNamespace(req_pool_idx=slot, kv_len=kv_len, draft=draft)
