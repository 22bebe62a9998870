"""Step-time model T(batch) of one speculative decode step, profiled then corrected online.

What a step costs (EAGLEWorkerV2): when some d_i > 0, a catch-up draft extend over the pending
positions of the drafting requests, max(d_i) - 1 single-token draft steps over the requests
still drafting, and one ragged target verify of sum(1 + d_i) tokens; when every d_i is 0, one
plain target decode. The model is linear in these features (seconds):

    T = c_const + c_bs * bs + c_verify * verify_tokens + c_draft * draft_tokens
        + c_steps * draft_steps + c_spec * spec_on + c_kv * kv_tokens
        + c_draft_reqs * draft_reqs

bs: requests in the step; verify_tokens: sum(1 + d_i); draft_tokens: tokens through the draft
model (catch-up tokens + sum over drafting requests of d_i - 1); draft_steps: draft forwards
(max d_i, 0 when nothing drafts); spec_on: 1 when any d_i > 0 (verification, expanded
sampling); kv_tokens: context tokens the batch attends to; draft_reqs: requests with d_i > 0
(the per-request host work of drafting: catch-up inputs, per-request draft and verify
bookkeeping; on SmolLM2 / H200 about 1 ms per drafting request, which without this feature
the fit had to put into `bs`, i.e. into plain steps too).

Online correction: discounted ridge regression towards the prior coefficients (recursive least
squares with forgetting factor `decay`, regularised by `prior_weight` pseudo observations of
the prior), so directions the recent steps do not excite (e.g. draft costs while nothing
drafts) stay at the profiled values instead of drifting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

FEATURES = (
    "const",
    "bs",
    "verify_tokens",
    "draft_tokens",
    "draft_steps",
    "spec_on",
    "kv_tokens",
    "draft_reqs",
)
# Typical magnitudes, to condition the regression (internal only).
_SCALES = np.array([1.0, 64.0, 256.0, 256.0, 4.0, 1.0, 65536.0, 64.0])
# A generic prior (seconds per unit) used when nothing was profiled or configured.
DEFAULT_COEF = {
    "const": 4e-3,
    "bs": 2e-5,
    "verify_tokens": 2e-5,
    "draft_tokens": 1e-5,
    "draft_steps": 4e-4,
    "spec_on": 5e-4,
    "kv_tokens": 1e-8,
    "draft_reqs": 2e-5,
}


def step_features(
    bs: int | np.ndarray,
    verify_tokens: int | np.ndarray,
    draft_tokens: int | np.ndarray,
    draft_steps: int | np.ndarray,
    kv_tokens: int | np.ndarray,
) -> np.ndarray:
    """Feature rows in FEATURES order for steps where every request drafts the same length
    (the warm-up sweep). Scalars give [F]; arrays of shape [m] give [m, F] float64 (spec_on
    is derived from draft_steps > 0, draft_reqs = bs when drafting, else 0)."""
    steps = np.asarray(draft_steps, dtype=np.float64)
    cols = [
        np.ones_like(steps),
        np.broadcast_to(np.asarray(bs, dtype=np.float64), steps.shape),
        np.asarray(verify_tokens, dtype=np.float64) + 0 * steps,
        np.asarray(draft_tokens, dtype=np.float64) + 0 * steps,
        steps,
        (steps > 0).astype(np.float64),
        np.broadcast_to(np.asarray(kv_tokens, dtype=np.float64), steps.shape),
        np.asarray(bs, dtype=np.float64) * (steps > 0),
    ]
    return np.stack(cols, axis=-1)


def allocation_features(
    draft_lens: Sequence[int] | np.ndarray, pending: Sequence[int] | np.ndarray, kv_tokens: int
) -> np.ndarray:
    """[F] features of one step where request i drafts draft_lens[i] tokens after catching up
    over pending[i] positions (pending counts only where d_i > 0)."""
    d = np.asarray(draft_lens, dtype=np.int64)
    p = np.asarray(pending, dtype=np.int64)
    on = d > 0
    draft = float((p[on] + d[on] - 1).sum())
    steps = float(d.max(initial=0))
    n = float(len(d))
    reqs = float(on.sum())
    return np.array([1.0, n, n + float(d.sum()), draft, steps, float(steps > 0), kv_tokens, reqs])


class StepTimeModel:
    """Linear step-time model (seconds) with online correction.

    Args:
        coef: prior coefficients by FEATURES name (missing names take DEFAULT_COEF).
        decay: forgetting factor per observed step, in (0, 1].
        prior_weight: pseudo observations pulling towards the prior (> 0).
        online: update from measured steps (False: the prior is fixed, e.g. a synthetic model).
    """

    def __init__(
        self,
        coef: dict[str, float] | None = None,
        decay: float = 0.98,
        prior_weight: float = 0.05,
        online: bool = True,
    ) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self.online = online
        self.num_updates = 0
        self._dirty = False  # updates not yet solved into theta (solved on the next read)
        self.set_prior(coef or {})

    def set_prior(self, coef: dict[str, float]) -> None:
        """Replace the prior (e.g. after profiling) and forget the online statistics."""
        unknown = set(coef) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-time features {sorted(unknown)}; known: {FEATURES}")
        full = {**DEFAULT_COEF, **coef}
        self.prior = np.array([full[f] for f in FEATURES]) * _SCALES  # scaled, [F]
        self.theta = self.prior.copy()
        n = len(FEATURES)
        self.gram = np.zeros((n, n))  # discounted sum of z z^T
        self.moment = np.zeros(n)  # discounted sum of z * y
        self._dirty = False

    def coefficients(self) -> dict[str, float]:
        """Current coefficients in seconds per unit of each feature."""
        self._solve()
        return {f: float(c) for f, c in zip(FEATURES, self.theta / _SCALES, strict=True)}

    def predict(self, x: np.ndarray) -> np.ndarray | float:
        """Step time in seconds for features x ([F] -> float, [m, F] -> [m]); at least 1 us."""
        self._solve()
        t = np.maximum((x / _SCALES) @ self.theta, 1e-6)
        return float(t) if t.ndim == 0 else t

    def predict_unsolved(self, x: np.ndarray) -> float:
        """predict for one step [F] with the coefficients of the last solve (no re-solve:
        for reporting on steps where the policy does not run)."""
        return max(float((x / _SCALES) @ self.theta), 1e-6)

    def update(self, x: np.ndarray, measured_s: float) -> None:
        """Correct the model with one measured step (x: [F], measured_s: seconds). A
        measurement is clipped to [1/3, 3] x the current prediction so one stall cannot wreck
        it. Only accumulates (a few microseconds); the coefficients are re-solved when next
        read, so steps nobody predicts for (reused all-zero choices) stay cheap."""
        if not self.online or not measured_s > 0:
            return
        z = x / _SCALES
        pred = self.predict_unsolved(x)
        y = min(max(measured_s, pred / 3.0), pred * 3.0)
        self.gram = self.gram * self.decay + np.outer(z, z)
        self.moment = self.moment * self.decay + z * y
        self.num_updates += 1
        self._dirty = True

    def _solve(self) -> None:
        if self._dirty:  # every feature costs time: never negative
            self.theta = _ridge_nonneg(self.gram, self.moment, self.prior, self.prior_weight)
            self._dirty = False


PLAIN_FEATURES = ("const", "bs", "verify_tokens", "kv_tokens")  # what a d = 0 step costs


def _ridge_nonneg(gram: np.ndarray, rhs: np.ndarray, prior: np.ndarray, lam: float) -> np.ndarray:
    """argmin t^T gram t - 2 rhs^T t + lam |t - prior|^2 subject to t >= 0 (a ridge least
    squares with normal matrix gram [c, c] and right side rhs [c]), by fixing the most negative
    coefficient at 0 and re-solving until none is negative. Collinear features (bs,
    verify_tokens and kv_tokens are proportional in a warm-up sweep) would otherwise get a
    large positive and a clipped negative coefficient. Returns [c]."""
    free = np.ones(len(prior), dtype=bool)
    t = np.zeros(len(prior))
    while free.any():
        g = gram[np.ix_(free, free)] + lam * np.eye(int(free.sum()))
        sol = np.linalg.solve(g, rhs[free] + lam * prior[free])
        if (sol >= 0).all():
            t[free] = sol
            break
        idx = np.flatnonzero(free)
        free[idx[int(np.argmin(sol))]] = False
    return t


def fit_coefficients(
    x: np.ndarray, y: np.ndarray, prior: dict[str, float] | None = None, weight: float = 1e-3
) -> dict[str, float]:
    """Fit step times y [m] seconds on features x [m, F] with non-negative coefficients.
    Returns seconds per unit by FEATURES name.

    In relative error (each row divided by its y), so a 2 ms step counts as much as a 300 ms
    one, and in two stages: the plain-step features on the rows that do not draft, then the
    drafting features on what those leave of the drafting rows. A single absolute fit over
    batch sizes 1..256 is dominated by the largest drafting steps; on SmolLM2 / H200 it put
    12.6 ms of constant cost into a 2 ms batch-1 plain step, so drafting looked almost free
    there. Each stage is a ridge fit towards `prior` (default DEFAULT_COEF) with `weight`
    relative to the mean diagonal of its normal matrix."""
    full = {**DEFAULT_COEF, **(prior or {})}
    theta0 = np.array([full[f] for f in FEATURES]) * _SCALES
    z = x / _SCALES
    y = np.asarray(y, dtype=np.float64)
    theta = theta0.copy()
    plain_cols = np.array([f in PLAIN_FEATURES for f in FEATURES])
    plain_rows = x[:, FEATURES.index("spec_on")] == 0
    stages = [(plain_rows, plain_cols), (~plain_rows, ~plain_cols)]
    if not plain_rows.any() or plain_rows.all():  # one kind of step only: one joint fit
        stages = [(np.ones(len(y), dtype=bool), np.ones(len(FEATURES), dtype=bool))]
    for rows, cols in stages:
        if not rows.any():
            continue
        fixed = z[rows][:, ~cols] @ theta[~cols]  # [r] what the other stage explains
        w = 1.0 / np.maximum(y[rows], 1e-6)  # [r]
        a_rows = z[rows][:, cols] * w[:, None]
        b_rows = (y[rows] - fixed) * w
        gram = a_rows.T @ a_rows
        lam = weight * float(np.mean(np.diag(gram))) + 1e-12
        theta[cols] = _ridge_nonneg(gram, a_rows.T @ b_rows, theta0[cols], lam)
    return {f: float(c) for f, c in zip(FEATURES, theta / _SCALES, strict=True)}


def profile_step_time(
    run_step: Callable[[int, int], float | None],
    batch_sizes: Sequence[int],
    draft_lens: Sequence[int],
    context_len: int,
    repeats: int = 3,
) -> dict[str, float]:
    """Warm-up sweep: time synthetic steps and fit the step-time coefficients.

    run_step(bs, d) runs one synthetic decode step of `bs` requests of `context_len` tokens,
    each drafting `d` tokens after a one-token catch-up (d = 0: plain decode), and returns its
    time in seconds (or None to time it here with time.perf_counter; the callable must then
    synchronise the device). The first call of each shape is a warm-up and is not used; the
    median of `repeats` timings is. Returns coefficients by FEATURES name."""
    xs, ys = [], []
    for bs in batch_sizes:
        for d in draft_lens:
            times = []
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                t = run_step(bs, d)
                t = time.perf_counter() - t0 if t is None else t
                if r > 0:
                    times.append(t)
            xs.append(step_features(bs, bs * (1 + d), bs * d, d, bs * context_len))
            ys.append(float(np.median(times)))
    return fit_coefficients(np.stack(xs), np.array(ys))
