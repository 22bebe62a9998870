"""Step-time model T(batch) of one speculative decode step, profiled then corrected online.

What a step costs (EAGLEWorkerV2): when some d_i > 0, a catch-up draft extend over the pending
positions of the drafting requests, max(d_i) - 1 single-token draft steps over the requests
still drafting, and one ragged target verify of sum(1 + d_i) tokens; when every d_i is 0, one
plain target decode. The model is linear in these features (seconds):

    T = c_const + c_bs * bs + c_verify * verify_tokens + c_draft * draft_tokens
        + c_steps * draft_steps + c_spec * spec_on + c_kv * kv_tokens
        + c_draft_reqs * draft_reqs + c_long * long_catchup

bs: requests in the step; verify_tokens: sum(1 + d_i); draft_tokens: tokens through the draft
model (catch-up tokens + sum over drafting requests of d_i - 1); draft_steps: draft forwards
(max d_i, 0 when nothing drafts); spec_on: 1 when any d_i > 0 (verification, expanded
sampling); kv_tokens: context tokens the batch attends to; draft_reqs: requests with d_i > 0
(the per-request host work of drafting: catch-up inputs, per-request draft and verify
bookkeeping; on SmolLM2 / H200 about 1 ms per drafting request, which without this feature
the fit had to put into `bs`, i.e. into plain steps too); long_catchup: 1 when a drafting
request catches up over more than K + 1 positions (a share of 1 where the policy spreads the
catch-up over the steps it enables, policy.amortized_pending), else 0.

Why long_catchup: the drafting step's CUDA graphs (the whole greedy chain, or the catch-up
extend) are captured for catch-ups of at most K + 1 tokens per request; a longer catch-up runs
the draft extend eagerly and then the draft steps one graph replay each. That is a fixed cost,
nearly independent of the catch-up's length: the H200 check of the warm-up fit
(`warmup_fit_h200_s28.json`, SmolLM2, K = 5) measured a catch-up over 64 positions at bs 1 at
+1.3 ms over a one-position one (3.58 against 2.24 ms), and over 200 positions at bs 128
(25,600 draft tokens) at +3.2 ms. Fitted through draft_tokens alone, the first was predicted
at 0.72x and the second at 1.8x its time.

Online correction: discounted ridge regression towards the prior coefficients (recursive least
squares with forgetting, regularised by `prior_weight` pseudo observations of the prior).

Forgetting is per regime, a regime being (whether the step drafted, its batch-size bucket
bs.bit_length()): a step multiplies its own regime's statistics by `decay` and every other
regime's by `idle_decay` (default 0.999, a half-life of ~700 steps). So a regime's
measurements fade as that regime is measured again, and more slowly while the server runs
other steps. One factor for
all (`idle_decay` = `decay`, the model before the twenty-sixth session) made the model forget
what drafting costs within ~150 plain steps: under load drafting is rare, so its coefficients
went back to the warm-up sweep's, which does not see what a drafting step costs in a server
(it drains the overlap pipeline; catch-up extends). On the H200 at c = 16 an adaptive SmolLM2
server then drafted again in every round of a paired run, at 2-3x the predicted step time in
every batch-size bucket (`spec_drafting_by_bs` of `paired_smollm2_never_h200_s26.json`:
bs 1 predicted 2.6 ms, measured 6.4 ms; bs 16-31 3.9 against 10.7 ms). The same held for
plain steps of batch sizes the load leaves alone (the tail of a burst, at bs 1-3, predicted from
the bs 16 steps around it). Directions that nothing has measured yet still stay at the prior.

The idle factor trades memory against two costs that a review helper showed (twenty-sixth
session, `python benchmark/simulate_adaptive_rounds.py --idle-sweep`): a kept measurement is
also kept when it was wrong, and stale regimes pull a linear fit that cannot fit them all. One
drafting step stalled (clipped to 3x its prediction) made drafting look 2.9x its cost for
more than 10,000 plain steps at 0.9999, for ~3,000 at 0.999 (2.3x at 3,000, 1.0x at 10,000);
after a burst at bs 65-250 whose steps cost more per request than at bs 12-19 (leaving the
captured graphs), a bs-16 plain step was over-predicted 1.48x 2,000 steps later at 0.9999, 1.11x
at 0.999, 1.01x at 0.98. In closed-loop rounds at c = 16 (1,200 steps each) 0.999 kept the
drafting cost through all but one of 11 rounds (18 drafting request-steps in one), 0.995
through about half, 0.98 through none.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    "long_catchup",
)
# Typical magnitudes, to condition the regression (internal only).
_SCALES = np.array([1.0, 64.0, 256.0, 256.0, 4.0, 1.0, 65536.0, 64.0, 1.0])
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
    "long_catchup": 1e-3,
}


def step_features(
    bs: int | np.ndarray,
    verify_tokens: int | np.ndarray,
    draft_tokens: int | np.ndarray,
    draft_steps: int | np.ndarray,
    kv_tokens: int | np.ndarray,
    long_catchup: float | np.ndarray = 0.0,
) -> np.ndarray:
    """Feature rows in FEATURES order for steps where every request drafts the same length
    (the warm-up sweep). Scalars give [F]; arrays of shape [m] give [m, F] float64 (spec_on
    is derived from draft_steps > 0, draft_reqs = bs when drafting, else 0; long_catchup
    counts only when drafting)."""
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
        np.asarray(long_catchup, dtype=np.float64) * (steps > 0),
    ]
    return np.stack(cols, axis=-1)


def plain_step_features(bs: int, kv_tokens: int) -> tuple[float, ...]:
    """The F features of a step where no request drafts (allocation_features of all zeros,
    without the per-request work), as a tuple: every decode step under load builds one, and a
    small numpy array costs several microseconds there (StepTimeModel takes either form)."""
    n = float(bs)
    return (1.0, n, n, 0.0, 0.0, 0.0, float(kv_tokens), 0.0, 0.0)


def allocation_features(
    draft_lens: Sequence[int] | np.ndarray,
    pending: Sequence[float] | np.ndarray,
    kv_tokens: int,
    long_share: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """[F] features of one step where request i drafts draft_lens[i] tokens after catching up
    over pending[i] positions (pending counts only where d_i > 0; float where the policy
    charges an amortized share of a long catch-up, policy.amortized_pending). long_share [n]:
    the share of a long catch-up's fixed cost charged to this step if request i drafts (1: its
    catch-up is over more than K + 1 positions and paid here; 0: none; None: all 0); the step
    pays the largest share among its drafting requests (one eager catch-up covers them all)."""
    d = np.asarray(draft_lens, dtype=np.int64)
    p = np.asarray(pending, dtype=np.float64)
    on = d > 0
    draft = float((p[on] + d[on] - 1).sum())
    steps = float(d.max(initial=0))
    n = float(len(d))
    reqs = float(on.sum())
    long = 0.0
    if long_share is not None:
        long = float(np.asarray(long_share, dtype=np.float64)[on].max(initial=0.0))
    return np.array(
        [1.0, n, n + float(d.sum()), draft, steps, float(steps > 0), kv_tokens, reqs, long]
    )


_BS, _SPEC_ON = FEATURES.index("bs"), FEATURES.index("spec_on")


def regime_codes(x: np.ndarray) -> np.ndarray:
    """[m] int64 regime of each feature row of x [m, F], the statistics its measurement joins
    (see the module docstring): 256 * (1 if the step drafted else 0) + bs.bit_length()
    (frexp's exponent of a positive integer is its bit_length)."""
    return (x[:, _SPEC_ON] > 0) * 256 + np.frexp(x[:, _BS].astype(np.int64))[1]


def regime(x: np.ndarray | Sequence[float]) -> tuple[int, int]:
    """(1 if the step drafted else 0, bs.bit_length()) of one feature row x [F]."""
    return divmod(int(regime_codes(np.asarray(x, dtype=np.float64)[None, :])[0]), 256)


class StepTimeModel:
    """Linear step-time model (seconds) with online correction.

    Args:
        coef: prior coefficients by FEATURES name (missing names take DEFAULT_COEF).
        decay: forgetting factor of a regime per step measured in it, in (0, 1].
        prior_weight: pseudo observations pulling towards the prior (> 0).
        online: update from measured steps (False: the prior is fixed, e.g. a synthetic model).
        idle_decay: forgetting factor of a regime per step measured in another regime, in
            (0, 1]; equal to decay, forgetting is the same for all (see the module docstring).
    """

    def __init__(
        self,
        coef: dict[str, float] | None = None,
        decay: float = 0.98,
        prior_weight: float = 0.05,
        online: bool = True,
        idle_decay: float = 0.999,
    ) -> None:
        self.decay = decay
        self.idle_decay = idle_decay
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
        # (theta, theta / _SCALES as floats) for predict_row; theta is replaced, never changed
        self._row_coef: tuple[np.ndarray, list[float]] | None = None
        # per regime (row r of _index): discounted statistics as of its last measured step
        # _last[r] (update index): _grams[r] [F, F] = sum w z z^T, _moments[r] [F] = sum w z y
        n = len(FEATURES)
        self._index: dict[int, int] = {}  # regime_codes value -> row
        self._grams = np.zeros((0, n, n))
        self._moments = np.zeros((0, n))
        self._last = np.zeros(0)
        # (x [F], seconds, update index) not yet folded
        self._rows: list[tuple[np.ndarray, float, int]] = []
        self._dirty = False

    @property
    def gram(self) -> np.ndarray:
        """[F, F] discounted sum of z z^T over every regime, as of the last folded update."""
        return self._total()[0]

    @property
    def moment(self) -> np.ndarray:
        """[F] discounted sum of z y over every regime, as of the last folded update."""
        return self._total()[1]

    def _total(self) -> tuple[np.ndarray, np.ndarray]:
        """(gram [F, F], moment [F]): every regime aged by idle_decay per step measured in
        another regime since its own last one."""
        n = len(FEATURES)
        if len(self._last) == 0:
            return np.zeros((n, n)), np.zeros(n)
        w = self.idle_decay ** (self._last.max() - self._last)  # [R]
        return (w @ self._grams.reshape(len(w), n * n)).reshape(n, n), w @ self._moments

    def coefficients(self) -> dict[str, float]:
        """Current coefficients in seconds per unit of each feature."""
        self._solve()
        return {f: float(c) for f, c in zip(FEATURES, self.theta / _SCALES, strict=True)}

    def predict(self, x: np.ndarray | Sequence[float]) -> np.ndarray | float:
        """Step time in seconds for features x ([F] -> float, [m, F] -> [m]; an array, or one
        row as a sequence, e.g. plain_step_features' tuple); at least 1 us."""
        self._solve()
        return self.predict_unsolved(x)

    def predict_unsolved(self, x: np.ndarray | Sequence[float]) -> np.ndarray | float:
        """predict with the coefficients of the last solve (no fold, no re-solve: at most
        SOLVE_EVERY buffered updates behind predict): for reporting on steps where the policy
        does not run, and for the policy's bound check."""
        t = np.maximum((x / _SCALES) @ self.theta, 1e-6)
        return float(t) if t.ndim == 0 else t

    def predict_row(self, x: Sequence[float]) -> float:
        """predict_unsolved of one [F] feature row in plain Python: the same products (the
        scales are powers of two, so x / scale * theta is x * (theta / scale) exactly), summed
        in order, where numpy's matrix product may sum in another order (equal up to
        rounding). For a policy run on a single request (AdaptiveController.
        _single_rules_out), where numpy's per-call cost dwarfs 9 products."""
        if self._row_coef is None or self._row_coef[0] is not self.theta:
            self._row_coef = (self.theta, (self.theta / _SCALES).tolist())
        t = 0.0
        for v, c in zip(x, self._row_coef[1], strict=True):
            t += v * c
        return max(t, 1e-6)

    def update(self, x: np.ndarray | Sequence[float], measured_s: float) -> None:
        """Correct the model with one measured step (x: [F] array or sequence, measured_s:
        seconds). A measurement is clipped to [1/3, 3] x the current prediction, so one stall
        moves the fit by at most that (and fades with its regime: see the module docstring).
        Buffers the measurement (a list append) and folds the buffer into the statistics and
        re-solves the coefficients when they are next read or every SOLVE_EVERY updates (the
        clip uses the last solve), so steps nobody predicts for (reused all-zero choices, the
        fixed and tiers baselines) stay cheap."""
        if not self.online or not measured_s > 0:
            return
        self._rows.append((x, measured_s, self.num_updates))  # folded in batches: an append
        self.num_updates += 1
        self._dirty = True
        if len(self._rows) >= SOLVE_EVERY:  # bounded staleness when nothing reads it
            self._solve()

    def _fold(self) -> None:
        """Add the buffered measurements to their regimes' statistics, as update() one at a
        time would: the same clip against the last solve (no solve happens in between), and
        each step multiplying its own regime by decay and every other by idle_decay. A regime
        measured at steps t_1 < ... < t_m (its previous statistics as of step L) becomes, as of
        t_m, old decay^m idle^(t_m - L - m) + sum_i z_i z_i^T decay^(m - i) idle^(t_m - t_i -
        (m - i)) (and the same for the moment); the other regimes keep their own `last`, and
        _total ages each by idle^(now - last)."""
        if not self._rows:
            return
        rows = self._rows
        x = np.array([r[0] for r in rows], dtype=np.float64)  # [m, F] (rows: arrays, tuples)
        z = x / _SCALES
        y = np.array([r[1] for r in rows])  # [m]
        steps = np.array([r[2] for r in rows], dtype=np.float64)  # [m]
        pred = np.maximum(z @ self.theta, 1e-6)
        y = np.minimum(np.maximum(y, pred / 3.0), pred * 3.0)
        codes = regime_codes(x)
        # (a set, not np.unique: numpy 2.4's unique took 80 us for 256 codes, a set 3.5)
        for code in sorted(set(codes.tolist())):
            idx = np.flatnonzero(codes == code)
            r = self._index.get(code)
            if r is None:  # a regime measured for the first time (at most 2 x bs buckets)
                r = self._index[code] = len(self._last)
                n = len(FEATURES)
                self._grams = np.concatenate([self._grams, np.zeros((1, n, n))])
                self._moments = np.concatenate([self._moments, np.zeros((1, n))])
                self._last = np.append(self._last, -1.0)
            t, m = steps[idx], len(idx)
            own_after = np.arange(m - 1, -1, -1, dtype=np.float64)  # own steps after row i
            w = self.decay**own_after * self.idle_decay ** (t[-1] - t - own_after)
            old = 0.0
            if self._last[r] >= 0:
                old = self.decay**m * self.idle_decay ** (t[-1] - self._last[r] - m)
            zi = z[idx]
            self._grams[r] = self._grams[r] * old + (zi * w[:, None]).T @ zi
            self._moments[r] = self._moments[r] * old + (w * y[idx]) @ zi
            self._last[r] = t[-1]
        self._rows.clear()

    def _solve(self) -> None:
        self._fold()
        if self._dirty:  # every feature costs time: never negative
            gram, moment = self._total()
            self.theta = _ridge_nonneg(gram, moment, self.prior, self.prior_weight)
            self._dirty = False


# Updates between re-solves when nothing reads the model (while nothing drafts, the policy's
# bound check reads the last solve, and nothing else does). A solve is ~0.1-0.2 ms of numpy in
# a loop, but 0.75 ms (64 rows) to 1.16 ms (256) inside a scheduler that solves once in many
# steps, with the caches cold (commit_host_cpu.json, labels "s31 bs1 online calls"); the
# adaptive commit's mean excess over a plain server's at batch 1 was 24.5 us per step with
# 64 and is 14.5 with 256 (CPU machine, `profile_commit_host.py --online`, commit_host_cpu.json
# labels "s31 bs1 online"); the bound check's coefficients are then up to 256 steps old.
SOLVE_EVERY = 256


def _ridge_nonneg(gram: np.ndarray, rhs: np.ndarray, prior: np.ndarray, lam: float) -> np.ndarray:
    """Approximately argmin t^T gram t - 2 rhs^T t + lam |t - prior|^2 subject to t >= 0 (a
    ridge least squares with normal matrix gram [c, c] and right side rhs [c]): fix the most
    negative coefficient at 0 and re-solve until none is negative (variables are never
    released, so on rare inputs this is slightly above the exact minimum). Collinear features
    (bs and kv_tokens are proportional in a warm-up sweep) would otherwise get a large positive
    and a clipped negative coefficient. Returns [c]."""
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
