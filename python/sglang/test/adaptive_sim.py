"""Synthetic pieces for the adaptive speculation tests (issue 7), shared by the
test/srt/test_adaptive_*.py files and test_deferred_draft_extend.py: the maximum draft length
K they use, step-time models with chosen coefficients, running requests as the adaptive
controller reads them, and closed-loop serving rounds of the controller on a simulated clock
(simulate_rounds, also run by benchmark/simulate_adaptive_rounds.py)."""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from sglang.srt.speculative.adaptive.step_time_model import (
    FEATURES,
    StepTimeModel,
    allocation_features,
    plain_step_features,
)

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


# Per-position acceptance of the bundled SmolLM2 draft on ShareGPT prompts, as the H200 server
# estimated it (spec_server_accept_rate_per_position, twenty-fifth session).
SMOLLM2_ALPHA = (0.6, 0.69, 0.75, 0.66, 0.53)


def h200_smollm2_step_s(bs: int, drafting_reqs: int, max_draft: int, after_drafting: bool) -> float:
    """Seconds of one decode step of a SmolLM2 server on the H200 at c = 16 (twenty-sixth
    session): a plain step 0.9 ms + 20 us per request; a drafting step 5 ms + 30 us per request
    + 0.3 ms per drafting request + 50 us per draft step (measured: 4.6-13 ms per drafting step
    in every batch-size bucket, `spec_drafting_by_bs` of paired_smollm2_never_h200_s26.json);
    a plain step right after a drafting step 2 ms (it runs unpipelined)."""
    if drafting_reqs:
        return 5e-3 + 30e-6 * bs + 0.3e-3 * drafting_reqs + 50e-6 * max_draft
    return 2e-3 if after_drafting else 0.9e-3 + 20e-6 * bs


@contextmanager
def _fake_clock(module, clock: list[float]):
    """module.time.perf_counter reads clock[0] inside the block."""
    real = module.time
    module.time = SimpleNamespace(perf_counter=lambda: clock[0])
    try:
        yield
    finally:
        module.time = real


def simulate_rounds(
    cfg: dict,
    rounds: int,
    num_reqs: int = 128,
    concurrency: int = 16,
    seed: int = 0,
    alpha: tuple[float, ...] = SMOLLM2_ALPHA,
    step_s=h200_smollm2_step_s,
) -> list[dict]:
    """Closed-loop rounds like paired_serving's, through an AdaptiveController (config cfg,
    as --speculative-adaptive-config's JSON object; K = len(alpha)) on a simulated clock: each
    round submits num_reqs requests of 96-160 output tokens, at most `concurrency` running, so
    a round fills up, runs at `concurrency` and drains. A new request lags its draft by 100
    positions when the controller has speculation off (drafting_off: its draft extend
    deferred), else by 1. Each draft position j is accepted with probability alpha[j] given
    the earlier ones; a step takes step_s(bs, drafting requests, max d, previous step
    drafted) seconds (the default charges no more for a long catch-up than for a short one,
    although the controller's model does). Returns per round {"drafting_request_steps",
    "steps", "tokens", "seconds"}."""
    from sglang.srt.speculative.adaptive import controller as ctl
    from sglang.srt.speculative.adaptive.registry import parse_adaptive_config

    k = len(alpha)
    clock = [0.0]
    out = []
    with _fake_clock(ctl, clock):
        c = ctl.AdaptiveController(
            parse_adaptive_config(json.dumps(cfg)), k, num_slots=4 * concurrency
        )
        rng = random.Random(seed)
        free = list(range(4 * concurrency))
        step, drafted_before = 0, False
        for _ in range(rounds):
            todo, running = num_reqs, []
            row = {"drafting_request_steps": 0, "steps": 0, "tokens": 0, "seconds": -clock[0]}
            while todo or running:
                while todo and len(running) < concurrency:
                    todo -= 1
                    slot = free.pop()
                    c.on_admit(slot)
                    lag = 100 if c.drafting_off() else 1
                    draft = SimpleNamespace(draft_kv_len=100 - lag, stale=False)
                    req = SimpleNamespace(req_pool_idx=slot, kv_len=100, draft=draft)
                    running.append((req, rng.randint(96, 160)))
                reqs = [r for r, _ in running]
                if c.reuse_zero(reqs):
                    d = [0] * len(reqs)
                else:
                    left = [n for _, n in running]
                    d = c.choose(reqs, [max(0, min(k, n - 1)) for n in left], left)
                acc = []
                for di in d:
                    a = 0
                    while a < di and rng.random() < alpha[a]:
                        a += 1
                    acc.append(a)
                nd = sum(1 for x in d if x)
                clock[0] += step_s(len(reqs), nd, max(d), drafted_before)
                drafted_before = nd > 0
                c.observe(reqs, d, acc, 0.5e-3, step)
                step += 1
                row["drafting_request_steps"] += nd
                row["steps"] += 1
                still = []
                for (req, n), di, a in zip(running, d, acc, strict=True):
                    if di:
                        req.draft.draft_kv_len = req.kv_len + a
                    req.kv_len += 1 + a
                    row["tokens"] += min(1 + a, n)
                    if n - 1 - a > 0:
                        still.append((req, n - 1 - a))
                    else:
                        free.append(req.req_pool_idx)
                running = still
            row["seconds"] += clock[0]
            out.append(row)
    return out


# The warm-up fit of an adaptive server on the H200 (twentieth session): a plain step of
# 1.39 ms (synthetic steps run unpipelined) and 0.75 ms more to draft.
H200_PRIOR = {
    "const": 1.39e-3,
    "verify_tokens": 1.0e-6,
    "draft_tokens": 2.3e-6,
    "draft_steps": 3.6e-7,
    "spec_on": 7.5e-4,
    "draft_reqs": 3.5e-6,
}


def stall_lock_in(idle: float) -> list[float]:
    """Predicted / prior cost of a bs-1 drafting step after one stalled measurement of it
    (clipped to 3x its prediction) and 1,000 / 3,000 / 10,000 plain bs-1 steps, at
    time_idle_decay `idle` (benchmark/simulate_adaptive_rounds.py --idle-sweep)."""
    m = StepTimeModel({**dict.fromkeys(FEATURES, 0.0), **H200_PRIOR}, idle_decay=idle)
    xd, xp = allocation_features([4], [1], 300), allocation_features([0], [1], 300)
    true_d = m.predict(xd)
    m.update(xd, 1.0)  # a one-off stall: clipped to 3x the prediction
    out, n = [], 0
    for target in (1000, 3000, 10000):
        while n < target:
            m.update(xp, H200_PRIOR["const"])
            n += 1
        out.append(round(float(m.predict(xd)) / true_d, 2))
    return out


def burst_drift(idle: float) -> list[float]:
    """Predicted / true cost of a bs-16 plain step 500 / 2,000 / 5,000 steps at bs 12-19 after
    600 at bs 65-250 whose steps cost more per request (1 ms + 20 us per request up to 64,
    6 ms + 40 us per request above: leaving the captured graphs), at time_idle_decay `idle`."""

    def truth(bs: int) -> float:
        return 1.0e-3 + 2e-5 * bs if bs <= 64 else 6e-3 + 4e-5 * bs

    rng = np.random.default_rng(0)
    m = StepTimeModel({}, idle_decay=idle)
    for _ in range(600):
        bs = int(rng.integers(65, 250))
        m.update(plain_step_features(bs, 300 * bs), truth(bs))
    out, n = [], 0
    for target in (500, 2000, 5000):
        while n < target:
            bs = int(rng.integers(12, 20))
            m.update(plain_step_features(bs, 300 * bs), truth(bs))
            n += 1
        out.append(round(float(m.predict(plain_step_features(16, 4800))) / truth(16), 2))
    return out
