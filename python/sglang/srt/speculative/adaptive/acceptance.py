"""Per-position draft acceptance estimates: one server-wide, one per request slot.

A chain draft of length d is verified left to right: draft position j (1-based) is *attempted*
when positions 1..j-1 were all accepted, and a step that accepted `a` drafts attempted
positions 1..min(a + 1, d) and accepted positions 1..a. So alpha_j, the probability that
position j is accepted given that 1..j-1 were, is estimated as accepts_j / attempts_j. This
factorisation is the one of the EAGLE-2 / SpecDec expected-length analyses (expected committed
tokens of a chain = 1 + sum_j prod_{i<=j} alpha_i; Leviathan et al. 2023, section 3.1, with a
position-dependent rate).

Counts decay geometrically so the estimates follow a changing workload:
- server-wide counts (decay `server_decay` per observed drafting request-step) give the prior;
- per-request counts (decay `request_decay` per drafting step of that request) are combined
  with the prior as Beta pseudo counts: alpha_rj = (acc_rj + s * alpha_j) / (att_rj + s),
  with s = `prior_strength`. A new request therefore starts at the server-wide average.

Exploration: a request that stops drafting produces no new observations, so a bad stretch
would keep it at d = 0 for good. Each step it does not draft, its own counts decay by
`idle_decay`, pulling its estimate back towards the server-wide prior; once that prior pays
again the policy retries it (after ~1 / (1 - idle_decay) idle steps). The decay is applied
lazily: a slot's row is brought up to date (idle_decay ** idle steps) when it is read or
drafts, so a step in which nothing drafts (the common step under load) costs O(1) here. A
running request is in every decode step, so its idle steps are the observed steps since its
row was last brought up to date.

Per-request rows are indexed by the request's ReqToTokenPool slot (`req_pool_idx`), so a whole
batch is gathered and updated with numpy fancy indexing; `reset_slot` clears a row when a
request is admitted into it.
"""

from __future__ import annotations

import numpy as np


class AcceptanceTracker:
    """Decayed per-position accept counts.

    Args:
        k: server draft length K (positions 1..K).
        num_slots: number of request slots (ReqToTokenPool.size).
        initial_accept: server-wide alpha before anything was observed, in [0, 1].
        server_prior_count: pseudo attempts behind `initial_accept` in the server-wide estimate.
        prior_strength: pseudo attempts of the server-wide prior in a request's estimate.
        server_decay, request_decay: count decay per observation, in (0, 1].
        idle_decay: per-request count decay per step in which the request does not draft.
    """

    def __init__(
        self,
        k: int,
        num_slots: int,
        initial_accept: float = 0.7,
        server_prior_count: float = 8.0,
        prior_strength: float = 4.0,
        server_decay: float = 0.999,
        request_decay: float = 0.95,
        idle_decay: float = 0.97,
    ) -> None:
        self.k = k
        self.initial_accept = initial_accept
        self.server_prior_count = server_prior_count
        self.prior_strength = prior_strength
        self.server_decay = server_decay
        self.request_decay = request_decay
        self.idle_decay = idle_decay
        self.server_att = np.zeros(k)  # [K] float64, decayed attempts per position
        self.server_acc = np.zeros(k)  # [K] float64, decayed accepts per position
        self.req_att = np.zeros((num_slots, k))  # [num_slots, K] float64
        self.req_acc = np.zeros((num_slots, k))  # [num_slots, K] float64
        self.steps = 0  # observe() calls so far
        # [num_slots] int64: observe() calls whose idle decay is already applied to each row
        self.synced = np.zeros(num_slots, dtype=np.int64)

    def reset_slot(self, slot: int) -> None:
        """Forget the request that used `slot` before (a new request was admitted there)."""
        self.req_att[slot] = 0.0
        self.req_acc[slot] = 0.0
        self.synced[slot] = self.steps

    def _sync(self, idx: np.ndarray) -> None:
        """Apply the idle decay of rows idx ([m] int64) owed since they were last synced."""
        if self.idle_decay < 1.0:
            f = self.idle_decay ** (self.steps - self.synced[idx]).astype(np.float64)
            self.req_att[idx] *= f[:, None]
            self.req_acc[idx] *= f[:, None]
        self.synced[idx] = self.steps

    def server_alpha(self) -> np.ndarray:
        """[K] float64: server-wide conditional acceptance per draft position."""
        s = self.server_prior_count
        return (self.server_acc + s * self.initial_accept) / (self.server_att + s)

    def alphas(self, slots: list[int]) -> np.ndarray:
        """[len(slots), K] float64: per-request conditional acceptance per draft position."""
        idx = np.asarray(slots, dtype=np.int64)
        self._sync(idx)
        s = self.prior_strength
        prior = self.server_alpha()[None, :]  # [1, K]
        return (self.req_acc[idx] + s * prior) / (self.req_att[idx] + s)

    def alpha_row(self, slot: int) -> list[float]:
        """alphas([slot])[0] as a list of K floats, computed in plain Python with the same
        operations in the same order (and the same update: the row's idle decay applied and
        synced). For a policy run on a single request (AdaptiveController._single_rules_out):
        alphas makes a dozen numpy calls, each far slower than its arithmetic when such a run
        comes once in many steps with the caches cold."""
        att = self.req_att[slot].tolist()
        acc = self.req_acc[slot].tolist()
        if self.idle_decay < 1.0:
            # numpy's power, as _sync's (its SIMD loop may round differently from math.pow)
            owed = np.array([self.steps - self.synced[slot]], dtype=np.float64)
            f = float(np.power(self.idle_decay, owed)[0])
            att = [a * f for a in att]
            acc = [a * f for a in acc]
            self.req_att[slot] = att
            self.req_acc[slot] = acc
        self.synced[slot] = self.steps
        s, ps = self.server_prior_count, self.prior_strength
        base = s * self.initial_accept
        out = []
        for srv_acc, srv_att, a, t in zip(
            self.server_acc.tolist(), self.server_att.tolist(), acc, att, strict=True
        ):
            prior = (srv_acc + base) / (srv_att + s)  # server_alpha()
            out.append((a + ps * prior) / (t + ps))
        return out

    def observe(self, slots: list[int], draft_lens: list[int], accepted: list[int]) -> None:
        """Record one verify step. draft_lens[i] = d_i proposed (0: nothing observed),
        accepted[i] = drafts accepted (0 <= accepted[i] <= d_i)."""
        if not any(draft_lens):  # every slot idle: their decay is applied when next read
            self.steps += 1
            return
        d = np.asarray(draft_lens, dtype=np.int64)
        a = np.asarray(accepted, dtype=np.int64)
        mask = d > 0
        d, a = d[mask], a[mask]
        idx = np.asarray(slots, dtype=np.int64)[mask]
        self._sync(idx)  # idle steps before this one
        self.steps += 1
        self.synced[idx] = self.steps  # this step was not idle for them
        pos = np.arange(1, self.k + 1)[None, :]  # [1, K]
        att = (pos <= np.minimum(a + 1, d)[:, None]).astype(np.float64)  # [m, K]
        acc = (pos <= a[:, None]).astype(np.float64)  # [m, K]
        self.req_att[idx] = self.req_att[idx] * self.request_decay + att
        self.req_acc[idx] = self.req_acc[idx] * self.request_decay + acc
        decay = self.server_decay ** len(idx)
        self.server_att = self.server_att * decay + att.sum(0)
        self.server_acc = self.server_acc * decay + acc.sum(0)

    def observe_idle(self) -> None:
        """observe() of a verify step where no request drafted (nothing observed; each slot's
        decay for the step is applied when it is next read)."""
        self.steps += 1


def expected_tokens(alpha: np.ndarray) -> np.ndarray:
    """Expected committed tokens for each draft length.

    alpha: [..., K] conditional acceptance per position. Returns [..., K + 1]: entry d is
    1 + sum_{j<=d} prod_{i<=j} alpha_i (the bonus/correction token always commits)."""
    gains = np.cumprod(alpha, axis=-1)  # [..., K] marginal expected tokens of draft j
    zero = np.zeros(alpha.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(gains, axis=-1)], axis=-1)
