"""Fitting the step-time model's coefficients (step_time_model.FEATURES) to timed steps: the
warm-up sweep of synthetic steps (profile_step_time) and the two-stage, relative-error,
non-negative fit it ends with (fit_coefficients). The online correction of a running server
is StepTimeModel's own (step_time_model.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from sglang.srt.speculative.adaptive.step_time_model import (
    _SCALES,
    DEFAULT_COEF,
    FEATURES,
    _ridge_nonneg,
    step_features,
)


def _relative_fit(
    a: np.ndarray, target: np.ndarray, step_s: np.ndarray, prior: np.ndarray, weight: float
) -> np.ndarray:
    """Non-negative ridge fit of target [r] on columns a [r, c] with each row divided by its
    step's time step_s [r] (relative error), towards prior [c] with weight relative to the
    mean diagonal of the normal matrix. Returns [c]."""
    w = 1.0 / np.maximum(step_s, 1e-9)
    aw = a * w[:, None]
    gram = aw.T @ aw
    lam = weight * float(np.mean(np.diag(gram))) + 1e-18
    return _ridge_nonneg(gram, aw.T @ (target * w), prior, lam)


def fit_coefficients(
    x: np.ndarray, y: np.ndarray, prior: dict[str, float] | None = None, weight: float = 1e-6
) -> dict[str, float]:
    """Fit step times y [m] seconds on features x [m, F] with non-negative coefficients.
    Returns seconds per unit by FEATURES name.

    In relative error (each row divided by its y), so a 2 ms step counts as much as a 300 ms
    one, and in two stages:

    1. plain steps (no draft): const, bs and kv_tokens (in a plain step verify_tokens = bs, so
       the two cannot be told apart there; when every step has the same context length, as
       in the warm-up sweep, kv_tokens is proportional to bs: one per-request cost is fitted,
       kv_tokens takes its prior out of it, at most all of it, and bs the rest);
    2. drafting steps, on what stage 1 leaves: verify_tokens through its extra tokens
       (verify_tokens - bs = sum d_i), draft_tokens, draft_steps, spec_on, draft_reqs,
       long_catchup; then
       c_bs -= c_verify so that plain steps keep their stage-1 prediction (a c_verify above
       c_bs is pinned at c_bs and the other drafting columns are refitted on what it leaves).

    A single absolute least-squares fit over batch sizes 1..256 is dominated by the largest
    drafting steps; on SmolLM2 / H200 it put 12.6 ms of constant cost into a 2 ms batch-1
    plain step, so drafting looked almost free there. With only one kind of step in x, one
    joint relative fit. `weight`: ridge towards `prior` (default DEFAULT_COEF)."""
    full = {**DEFAULT_COEF, **(prior or {})}
    theta0 = np.array([full[f] for f in FEATURES]) * _SCALES
    y = np.asarray(y, dtype=np.float64)
    ok = (y > 0) & (x[:, FEATURES.index("bs")] > 0)  # a failed or empty timing says nothing
    x, y = x[ok], y[ok]
    if len(y) == 0:
        return dict(full)
    z = x / _SCALES
    col = {f: i for i, f in enumerate(FEATURES)}
    plain = x[:, col["spec_on"]] == 0
    if plain.all() or not plain.any():
        theta = _relative_fit(z, y, y, theta0, weight)
        return {f: float(c) for f, c in zip(FEATURES, theta / _SCALES, strict=True)}
    theta = np.zeros(len(FEATURES))
    s1 = [col["const"], col["bs"], col["kv_tokens"]]
    kv, bs = x[plain, col["kv_tokens"]], x[plain, col["bs"]]
    ctx = kv[0] / bs[0]
    one_ctx = bool(np.allclose(kv, bs * ctx))
    if one_ctx:  # kv_tokens = ctx * bs: fit one per-request cost, split it below
        s1 = s1[:2]
    theta[s1] = _relative_fit(z[plain][:, s1], y[plain], y[plain], theta0[s1], weight)
    if one_ctx:
        # one context length cannot tell per-request from per-context-token cost: kv_tokens
        # takes its prior, at most the whole per-request cost, and bs the rest (online
        # correction sees real context lengths)
        per_req = theta[col["bs"]] / _SCALES[col["bs"]]
        c_kv = min(full["kv_tokens"], per_req / ctx) if ctx > 0 else 0.0
        theta[col["kv_tokens"]] = c_kv * _SCALES[col["kv_tokens"]]
        theta[col["bs"]] = (per_req - c_kv * ctx) * _SCALES[col["bs"]]
    s2 = [
        col[f]
        for f in (
            "verify_tokens",
            "draft_tokens",
            "draft_steps",
            "spec_on",
            "draft_reqs",
            "long_catchup",
        )
    ]
    a2 = z[~plain][:, s2].copy()
    # the verify column through its extra tokens only (in units of the verify_tokens scale)
    extra = x[~plain, col["verify_tokens"]] - x[~plain, col["bs"]]
    a2[:, 0] = extra / _SCALES[col["verify_tokens"]]
    rest = y[~plain] - z[~plain] @ theta  # stage 1's prediction (the s2 entries are still 0)
    theta[s2] = _relative_fit(a2, rest, y[~plain], theta0[s2], weight)
    # plain steps keep their stage-1 prediction: c_bs + c_verify is what stage 1 fitted, so
    # c_verify may not exceed it; when it does, it is pinned there and the other drafting
    # columns are refitted on what it leaves (without the sweep's catch-up steps, draft_tokens
    # equals the extra verify tokens and takes the excess; with them, a fixed move of the
    # excess into draft_tokens over-predicted long catch-ups up to 126x in a review's 2,000
    # random models, where the refit is within 0.4 of the truth)
    c_bs = theta[col["bs"]] / _SCALES[col["bs"]]
    if theta[s2[0]] / _SCALES[col["verify_tokens"]] > c_bs:
        theta[s2[0]] = c_bs * _SCALES[col["verify_tokens"]]
        left = rest - a2[:, 0] * theta[s2[0]]
        theta[s2[1:]] = _relative_fit(a2[:, 1:], left, y[~plain], theta0[s2[1:]], weight)
    coef = theta / _SCALES
    coef[col["bs"]] -= coef[col["verify_tokens"]]
    return {f: float(max(c, 0.0)) for f, c in zip(FEATURES, coef, strict=True)}


def profile_step_time(
    run_step: Callable[..., float | None],
    batch_sizes: Sequence[int],
    draft_lens: Sequence[int],
    context_len: int,
    repeats: int = 3,
    catchup_probe: int = 0,
    catchup_max_tokens: int | None = None,
) -> dict[str, float]:
    """Warm-up sweep: time synthetic steps and fit the step-time coefficients.

    run_step(bs, d) runs one synthetic decode step of `bs` requests of `context_len` tokens,
    each drafting `d` tokens after a one-token catch-up (d = 0: plain decode), and returns its
    time in seconds (or None to time it here with time.perf_counter; the callable must then
    synchronise the device). The first call of each shape is a warm-up and is not used; the
    median of `repeats` timings is. Returns coefficients by FEATURES name.

    catchup_probe p > 1 (at most context_len) adds, per batch size, run_step(bs, 1, p): one
    draft token after a catch-up over p positions per request, at the batch sizes where bs * p
    is at most catchup_max_tokens (None: all). Without it every drafting step
    of the sweep has draft_tokens = verify_tokens - bs = bs * d, so the fit cannot tell the
    draft model's tokens from the verify's and may put the whole cost on either: on the H200
    (twenty-seventh session) it set draft_tokens to 0.0, so a catch-up over thousands of
    pending positions looked free, and an adaptive SmolLM2 server at c = 256 drafted a step of
    100 requests predicted at 6.1 ms that took 22.9 ms (`spec_drafting_by_bs` of
    `paired_smollm2_c256_h200_s27.json`). A probe longer than K + 1 = max(draft_lens) + 1
    positions is a long catch-up (long_catchup = 1): with probes at several batch sizes the
    fit tells its fixed cost from the per-token one."""
    xs, ys = [], []

    def timed(shape: tuple, args: tuple) -> None:
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            t = run_step(*args)
            t = time.perf_counter() - t0 if t is None else t
            if r > 0:
                times.append(t)
        xs.append(step_features(*shape))
        ys.append(float(np.median(times)))

    probe = catchup_probe > 1 and max(draft_lens, default=0) >= 1
    long = float(catchup_probe > max(draft_lens, default=0) + 1)  # beyond the K + 1 graphs
    for bs in batch_sizes:
        for d in draft_lens:
            timed((bs, bs * (1 + d), bs * d, d, bs * context_len), (bs, d))
        fits = catchup_max_tokens is None or bs * catchup_probe <= catchup_max_tokens
        if probe and fits:  # one draft token after p pending positions: p draft-model tokens
            shape = (bs, 2 * bs, bs * catchup_probe, 1, bs * context_len, long)
            timed(shape, (bs, 1, catchup_probe))
    return fit_coefficients(np.stack(xs), np.array(ys))
