"""Goodput policy: per-request draft lengths that maximise the batch's committed tokens per
second, chosen every decode step.

For request r drafting d_r tokens, E[tokens_r(d_r)] = 1 + sum_{j<=d_r} prod_{i<=j} alpha_{r,i}
(the bonus/correction token always commits; alpha from AcceptanceTracker). The step takes
T(d) seconds (StepTimeModel: wall time per step, scheduler work included). The policy
maximises sum_r E[tokens_r(d_r)] / T(d) over 0 <= d_r <= cap_r:

1. Greedy marginal allocation: starting from all zeros, the next draft token goes to the
   request whose next token adds the most expected tokens (prod_{i<=d_r+1} alpha_{r,i}; these
   gains never increase along a request, so the greedy order is one stable sort of all gains).
2. Every prefix of that order is scored with the step-time model and the best one is taken.
   Scoring all prefixes rather than stopping at the first one that does not improve matters
   because T is not convex in the allocation: the first draft token of a step pays the fixed
   cost of drafting (spec_on, one draft forward), which many tokens together may amortise.
   This runs once per depth limit L = 1..K (every d_r <= L), because each draft step costs
   a forward for the whole batch (max d_r forwards), which favours breadth over depth, and
   for a second, request-major order (each request's drafts together), because a cost per
   drafting request (draft_reqs) favours depth over breadth.
3. Hysteresis: last step's allocation (clipped to this step's caps; new requests take the new
   choice) is kept unless the new allocation is predicted to be better by more than a relative
   margin `hysteresis`, so a stable input does not flap between drafting and not drafting.

When no prefix beats all zeros, every d_r is 0 and the step is a plain decode.

Catch-up cost: a request that did not draft for a while (or whose prefill deferred its draft
extend) lags its draft by many positions, and its first drafting step runs the catch-up extend
over all of them. That is paid once: afterwards each drafting step catches up over at most
K + 1 positions. Charging the whole catch-up to one step would make drafting look costly
until the lag was gone, which it never is without drafting, so a long prompt admitted while
speculation was off would never draft. The controller charges the step the positions up to
cap + 1 (K + 1 at most) and 1/h of the rest (amortized_pending), h = the drafting steps the
request has left (drafting_steps_left: the tokens it may still generate over a drafting
step's expected tokens) capped at `catchup_horizon`: spreading a one-time cost C over the h
steps it enables turns h E / (C + h T) into E / (T + C / h), the rate the policy maximises.
A catch-up beyond those K + 1 positions also has a fixed cost (it runs outside the drafting
step's CUDA graphs: the step time model's long_catchup), spread the same way (long_share).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sglang.srt.speculative.adaptive.step_time_model import FEATURES, allocation_features

# Seconds for a [m, F] feature matrix -> [m].
TimeFn = Callable[[np.ndarray], np.ndarray]


@dataclass
class BatchView:
    """What a policy sees of the running batch (n requests, server draft length K).

    caps: [n] int64, largest allowed d_r this step (SpecScheduler.draft_len_cap);
    alphas: [n, K] float64, conditional acceptance per draft position;
    pending: [n] float64, catch-up positions charged to this step if r drafts (the draft
        extend covers all of r's pending positions; see amortized_pending);
    prev: [n] int64, r's draft length in its previous decode step (-1: none yet);
    kv_tokens: context tokens of the batch;
    long_share: [n] float64, the share of a long catch-up's fixed cost (the step time model's
        long_catchup) charged to this step if r drafts: 0 when r's catch-up fits the K + 1
        positions of the drafting graphs, else 1/h as for pending (None: all 0).
    """

    caps: np.ndarray
    alphas: np.ndarray
    pending: np.ndarray
    prev: np.ndarray
    kv_tokens: int
    long_share: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.long_share is None:
            self.long_share = np.zeros(len(self.caps))

    @property
    def size(self) -> int:
        return len(self.caps)


def spread_steps(steps_left: np.ndarray, horizon: int) -> np.ndarray:
    """[n] float64 h = min(max(steps_left, 1), horizon): the drafting steps a long catch-up's
    one-time cost (its positions beyond cap + 1, and its fixed cost, long_share) is spread
    over (see the module docstring)."""
    return np.clip(np.asarray(steps_left, dtype=np.float64), 1.0, float(max(horizon, 1)))


def amortized_pending(
    pending: np.ndarray, steps_left: np.ndarray, steady: np.ndarray | int, horizon: int
) -> np.ndarray:
    """[n] float64 catch-up positions to charge this step for requests that would catch up
    over pending [n] positions and have about steps_left [n] (float) drafting steps left:
    the first `steady` positions ([n] or one for all: cap + 1, a drafting request's usual
    catch-up at most) in full, the rest spread over h = min(max(steps_left, 1), horizon)
    steps (see the module docstring). horizon 1 charges everything to this step."""
    p = np.asarray(pending, dtype=np.float64)
    return np.minimum(p, steady) + np.maximum(p - steady, 0.0) / spread_steps(steps_left, horizon)


def drafting_steps_left(
    tokens_left: np.ndarray, alphas: np.ndarray, caps: np.ndarray
) -> np.ndarray:
    """[n] float64 expected drafting steps a request has left: the tokens it may still
    generate, tokens_left [n], over the tokens a step drafting its cap commits in expectation
    (1 + sum_{j <= cap} prod_{i <= j} alpha_i; alphas [n, K], caps [n])."""
    gains = np.cumprod(alphas, axis=1)
    per_step = 1.0 + (gains * (np.arange(alphas.shape[1])[None, :] < caps[:, None])).sum(1)
    return np.asarray(tokens_left, dtype=np.float64) / per_step


def single_request_bound_rates(
    alpha: Sequence[float],
    cap: int,
    left: int | None,
    pending: int,
    kv_tokens: int,
    k: int,
    horizon: int,
    predict_row: Callable[[Sequence[float]], float],
) -> tuple[float, float]:
    """GoodputPolicy._bound_rates for a batch of one request, in plain Python, on the BatchView
    that AdaptiveController._run_policy builds for it: (upper bound on any drafting
    allocation's rate, the all-zero rate), tokens per second; nothing can beat all zeros when
    the first is at most the second.

    alpha: [K] the request's conditional acceptance per position; cap >= 1 its length cap;
    left: tokens it may still generate (None: a full horizon of drafting steps); pending: its
    catch-up positions (not amortized); kv_tokens: its context; k: the server's K; horizon:
    cfg.catchup_horizon; predict_row: seconds of one [F] feature row (StepTimeModel.
    predict_row). The same operations in the same order as drafting_steps_left,
    amortized_pending, the long catch-up share and the bound, except sums numpy may take in
    another order (equal up to rounding)."""
    gains = []  # expected tokens added by draft j < cap (cumulative products)
    g = 1.0
    for a in alpha[:cap]:
        g *= a
        gains.append(g)
    steps = float(horizon) if left is None else left / (1.0 + sum(gains))  # drafting_steps_left
    h = min(max(steps, 1.0), float(max(horizon, 1)))  # spread_steps
    p = float(pending)
    steady = cap + 1
    pend = min(p, steady) + max(p - steady, 0.0) / h  # amortized_pending
    share = 1.0 / h if p > k + 1 else 0.0  # long_share
    kv = float(kv_tokens)
    # the four rows of _bound_rates at n = 1, in FEATURES order
    t0 = predict_row((1.0, 1.0, 1.0, 0.0, 0.0, 0.0, kv, 0.0, 0.0))
    t1 = predict_row((1.0, 1.0, 2.0, pend, 1.0, 1.0, kv, 1.0, share))
    t_same = predict_row((1.0, 1.0, 3.0, pend + 1, 1.0, 1.0, kv, 1.0, share))
    t_other = predict_row((1.0, 1.0, 3.0, 2 * pend, 1.0, 1.0, kv, 2.0, share))
    delta = max(min(t_same, t_other) - t1, 0.0)
    top, total = 0.0, 0.0
    for m, gain in enumerate(sorted(gains, reverse=True)):
        total += gain
        top = max(top, (1.0 + total) / (t1 + delta * m))
    return top, 1.0 / t0


def expected_batch_tokens(alphas: np.ndarray, d: np.ndarray) -> float:
    """sum_r E[tokens_r(d_r)] for alphas [n, K] and draft lengths d [n]."""
    gains = np.cumprod(alphas, axis=1)  # [n, K]
    pos = np.arange(1, alphas.shape[1] + 1)[None, :]
    return float(len(d) + (gains * (pos <= d[:, None])).sum())


class GoodputPolicy:
    """Maximise predicted committed tokens per second (see module docstring)."""

    name = "goodput"

    def __init__(self, hysteresis: float = 0.02) -> None:
        self.hysteresis = hysteresis
        # the returned allocation's predicted rate, or what rates it when read (view,
        # allocation, time function): under load the policy's runs return all zeros with no
        # rate to compare, and rating them anyway cost ~70 us a run on the CPU machine
        self._rated: float | tuple[BatchView, np.ndarray, TimeFn] | Callable[[], float] = 0.0
        self.last_bound_ratio: float | None = None  # see choose

    @property
    def last_predicted_rate(self) -> float:
        """Predicted committed tokens per second of the last returned allocation (0 before
        any), rated when read with the model's coefficients of the last solve (reading it
        re-solves nothing)."""
        if isinstance(self._rated, tuple):
            self._rated = self.rate(*self._rated)
        elif callable(self._rated):  # note_all_zero's
            self._rated = self._rated()
        return self._rated

    def choose(
        self, view: BatchView, time_fn: TimeFn, bound_fn: TimeFn | None = None
    ) -> np.ndarray:
        """[n] int64 draft lengths, 0 <= d_r <= caps[r].

        bound_fn (default time_fn): the step-time model for the bound check that rules
        drafting out (_bound_rates) and for the rate reported with an all-zero choice.
        The controller passes its model with the coefficients of the last solve: a check that
        rules drafting out, the common case under load, then costs no re-solve of the model
        (60% of the check's samples, 27% of the policy's, in the tenth session's py-spy of a
        server at c = 2: benchmark/results/serve_pyspy_policy_h200_s10.json),
        and a choice it rules out is seen at most one solve late (every SOLVE_EVERY updates,
        or at the next fresh read). Any allocation that may draft is scored with time_fn."""
        bound = time_fn if bound_fn is None else bound_fn
        report: dict = {}
        best = self.best_allocation(view, time_fn, bound, report)
        # the bound check's ratio when it ruled drafting out, else None (AdaptiveController:
        # recheck_margin)
        self.last_bound_ratio = report.get("bound_ratio")
        keep = np.where(view.prev >= 0, np.minimum(view.prev, view.caps), best)
        if np.array_equal(keep, best):
            # bound (the controller's last solve, no re-solve when read): equal to time_fn's
            # rating here, since choosing a drafting allocation just solved the model
            self._rated = (view, best, bound)
            return best
        rate_best = self.rate(view, best, time_fn)
        rate_keep = self.rate(view, keep, time_fn)
        if rate_best > rate_keep * (1.0 + self.hysteresis):
            self._rated = rate_best
            return best
        self._rated = rate_keep
        return keep

    def note_all_zero(self, bound_ratio: float, plain_rate: Callable[[], float]) -> None:
        """Record a run that returned all zeros because the bound check ruled drafting out,
        decided outside choose (AdaptiveController._single_rules_out): its bound ratio, and
        what rates it, the plain rate in tokens per second, computed when last_predicted_rate
        is read (as choose rates all zeros: with the model's coefficients at that time)."""
        self.last_bound_ratio = bound_ratio
        self._rated = plain_rate

    @staticmethod
    def rate(view: BatchView, d: np.ndarray, time_fn: TimeFn) -> float:
        """Predicted committed tokens per second of allocation d [n]."""
        x = allocation_features(d, view.pending, view.kv_tokens, view.long_share)
        t = float(time_fn(x[None, :])[0])
        return expected_batch_tokens(view.alphas, d) / t

    @staticmethod
    def best_allocation(
        view: BatchView,
        time_fn: TimeFn,
        bound_fn: TimeFn | None = None,
        report: dict | None = None,
    ) -> np.ndarray:
        """The best prefix, over every depth limit L = 1..K (d_r <= L; a step costs max(d_r)
        draft forwards, which an order by expected tokens alone does not see), of two orders of
        the draft tokens, or all zeros:

        - the greedy marginal order (next token to the request whose next token adds the most
          expected tokens), which spreads drafts over requests;
        - the request-major order (requests by their first draft's gain, each request's tokens
          together), which concentrates them: with a per-drafting-request cost (draft_reqs)
          one request drafting three tokens can beat three requests drafting one each;
        - where some request's catch-up goes beyond K + 1 positions (long_share > 0), also
          requests by first gain per catch-up position, and the greedy order without those
          requests: a costly first draft that gains the most would head both orders above
          (on 600 random 3-request batches the first two orders found the brute-force optimum
          in 90%, these four in 97%: test_long_catch_ups_are_skipped_where_they_do_not_pay).

        bound_fn (default time_fn) is the model of the check that rules drafting out. When
        that check rules it out and `report` is given, report["bound_ratio"] is its upper
        bound on a drafting rate over the all-zero rate (<= 1; how far drafting is from
        paying). Returns [n] int64."""
        n, k = view.alphas.shape
        gains = np.cumprod(view.alphas, axis=1)  # [n, K] expected tokens added by draft j
        valid = np.arange(k)[None, :] < view.caps[:, None]  # [n, K]
        rows, js = np.nonzero(valid)  # row-major: j ascending within a request
        if len(rows) == 0:
            return np.zeros(n, dtype=np.int64)
        bound = time_fn if bound_fn is None else bound_fn
        top, plain = GoodputPolicy._bound_rates(view, bound, gains[rows, js], rows, js)
        if top <= plain:
            if report is not None:
                report["bound_ratio"] = top / plain
            return np.zeros(n, dtype=np.int64)
        greedy = np.argsort(-gains[rows, js], kind="stable")
        by_request = np.argsort(-gains[rows, 0], kind="stable")  # keeps j ascending
        orders = [greedy, by_request]
        long = view.long_share[rows] > 0
        if long.any():
            # Catch-ups beyond K + 1 positions: a request's first draft may cost far more than
            # its gain says, which neither order sees. Also try requests by first gain per
            # catch-up position, and the greedy order without the long catch-ups.
            per_cost = gains[rows, 0] / np.maximum(view.pending[rows], 1.0)
            orders.append(np.argsort(-per_cost, kind="stable"))
            if not long.all():
                orders.append(greedy[~long[greedy]])
        best_rate, best = -1.0, np.zeros(n, dtype=np.int64)
        for order in orders:
            rate, alloc = GoodputPolicy._best_prefix(view, time_fn, rows[order], js[order], gains)
            if rate > best_rate:
                best_rate, best = rate, alloc
        return best

    @staticmethod
    def _bound_rates(
        view: BatchView, time_fn: TimeFn, g: np.ndarray, rows: np.ndarray, js: np.ndarray
    ) -> tuple[float, float]:
        """(upper bound on any drafting allocation's rate, the all-zero rate), tokens/s: no
        allocation can beat all zeros when the first is at most the second (the common
        case under load, without scoring the orders, which takes 0.68 ms at batch 256 on the CPU
        machine: benchmark/results/adaptive_host_cpu.json). With time_fn linear
        in the features and non-decreasing in each (non-negative coefficients), m draft tokens
        cost at least T1 + delta (m - 1), where T1 is the cheapest drafting step (one request,
        one token, the shortest catch-up) and delta the cheapest further token (same request,
        or another request's first), and add at most G_m, the sum of the m largest gains g
        [m] of the allowed tokens (rows, js). Nothing pays if max_m (n + G_m) / (T1 + delta
        (m - 1)) <= n / T0."""
        n = view.alphas.shape[0]
        first = js == 0
        p_min = float(view.pending[rows[first]].min()) if first.any() else 1.0
        # the smallest long catch-up share of any request (a lower bound, as p_min, even where
        # the two minima belong to different requests: every coefficient is non-negative)
        s_min = float(view.long_share[rows[first]].min()) if first.any() else 0.0
        kv = float(view.kv_tokens)
        x = np.array(  # [4, F] in FEATURES order, one array built at once (a run under load)
            [
                [1.0, n, n, 0.0, 0.0, 0.0, kv, 0.0, 0.0],  # nothing drafts
                [1.0, n, n + 1, p_min, 1.0, 1.0, kv, 1.0, s_min],  # one request's first token
                [1.0, n, n + 2, p_min + 1, 1.0, 1.0, kv, 1.0, s_min],  # its second token
                [1.0, n, n + 2, 2 * p_min, 1.0, 1.0, kv, 2.0, s_min],  # another request's first
            ]
        )
        t0, t1, t_same, t_other = time_fn(x)
        delta = max(min(t_same, t_other) - t1, 0.0)
        gm = np.cumsum(np.sort(g)[::-1])  # [m] G_1 .. G_m
        bound = (n + gm) / (t1 + delta * np.arange(len(gm)))
        return float(bound.max()), n / t0

    @staticmethod
    def _best_prefix(
        view: BatchView, time_fn: TimeFn, rows: np.ndarray, js: np.ndarray, gains: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """(rate, allocation [n] int64) of the best prefix of the token order (rows[i], js[i])
        [m] under every depth limit, all zeros included (all in one vectorised evaluation)."""
        n = view.alphas.shape[0]
        depths = np.arange(1, int(js.max()) + 2)[:, None]  # [D, 1]
        sel = js[None, :] < depths  # [D, m] the order under depth limit L = row + 1
        # Per increment: expected tokens added; draft-model tokens added (the first draft of a
        # request costs its catch-up extend over the pending positions, the first draft comes
        # out of it; each further draft one single-token draft step, as allocation_features).
        cost = np.where(js == 0, view.pending[rows], 1)
        x = np.zeros((len(depths), len(rows) + 1, len(FEATURES)))  # [D, m + 1, F] prefixes
        x[:, :, 0] = 1.0
        x[:, :, 1] = n
        x[:, 1:, 2] = np.cumsum(sel, axis=1)
        x[:, :, 2] += n
        x[:, 1:, 3] = np.cumsum(sel * cost, axis=1)
        x[:, 1:, 4] = np.maximum.accumulate(sel * (js + 1), axis=1)
        x[:, :, 5] = x[:, :, 4] > 0
        x[:, :, 6] = view.kv_tokens
        x[:, 1:, 7] = np.cumsum(sel & (js == 0), axis=1)  # requests drafting
        # the largest long catch-up share among the drafting requests (allocation_features)
        x[:, 1:, 8] = np.maximum.accumulate(sel * view.long_share[rows], axis=1)
        tokens = np.zeros((len(depths), len(rows) + 1))
        tokens[:, 1:] = np.cumsum(sel * gains[rows, js], axis=1)
        rates = (n + tokens) / time_fn(x.reshape(-1, len(FEATURES))).reshape(tokens.shape)
        best = int(np.argmax(rates))  # first maximum: fewest increments, lowest depth
        depth, end = divmod(best, len(rows) + 1)
        take = rows[:end][sel[depth, :end]]
        return float(rates.flat[best]), np.bincount(take, minlength=n).astype(np.int64)
