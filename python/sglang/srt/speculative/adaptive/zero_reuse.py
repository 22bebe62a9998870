"""ZeroReuse: when the adaptive controller may reuse the goodput policy's last all-zero choice
instead of running the policy again (AdaptiveController.reuse_zero).

Under load, where requests join and finish nearly every step, this keeps the decision's host
cost (the policy's numpy work, ~0.1-0.7 ms per run on the CPU machine, more on a GPU host, plus
each request's cap) off almost every step. A heuristic with a bounded delay: a larger batch or
a newly joined request (at the server-wide acceptance prior) can make drafting pay, and that is
then seen at the recheck, at most one window late (recheck_max - 1 steps, 127 by default, once
the policy has kept choosing zeros for a while), and so is a batch that shrank by less than
recheck_shrink; a batch that shrank more re-runs the policy at once (its window keeps
doubling if it chooses zeros again), unless the last run's bound check shows that drafting
cannot pay at the smaller batch either (recheck_margin, far_from_paying). The
fixed and tiers baselines are never reused (they cost almost nothing and must do what they are
configured to do, e.g. a tier table that drafts more for larger batches). Zeros are within any
caps.
"""

from __future__ import annotations

import math


class ZeroReuse:
    """The reuse window of an all-zero choice (cfg.recheck_every, recheck_max, recheck_shrink,
    recheck_margin of AdaptiveConfig).

    State: `left`, the steps the last all-zero choice may still be reused for; `bs`, the batch
    size of its run; `window`, the reuse window of the next all-zero choice (recheck_every
    after a run that drafted, doubling with each further all-zero run up to
    max(recheck_max, recheck_every)); `ratio`, the last all-zero run's bound ratio
    (GoodputPolicy.last_bound_ratio), or None.
    """

    def __init__(self, every: int, max_window: int, shrink: float, margin: float) -> None:
        self.every, self.max_window = every, max(max_window, every)
        self.shrink, self.margin = shrink, margin
        self.left = 0
        self.bs = 0
        self.window = every
        self.ratio: float | None = None

    def take(self, bs: int) -> bool:
        """True (and one reuse counted) when the last all-zero choice is less than its window
        old and the batch, now bs requests, has not shrunk since (shrunk)."""
        if self.left <= 0 or self.shrunk(bs):
            return False
        self.left -= 1
        return True

    def expire(self) -> None:
        """The next step runs the policy (nothing could draft this step)."""
        self.left = 0

    def far_from_paying(self, bs: int) -> bool:
        """Whether a shrink to bs requests may keep the last all-zero choice: margin > 0, the
        last all-zero run's bound check put the best drafting rate at most `margin` of the
        plain rate (ratio), bs is at least half of the batch it ran on (self.bs), and ratio *
        self.bs <= bs.

        The last condition makes the skip safe under the bound check's own assumptions
        (GoodputPolicy._bound_rates: a step-time model linear in the features with
        non-negative coefficients, each request's acceptance estimate unchanged): for the
        bs requests that remain, the bound's ratio is at most ratio * self.bs / bs, whichever
        requests left (those that remain can carry all the gains; their steps save the same
        plain cost Delta in the plain and the drafting time, and T0 / D <= (T0 + Delta) / (D +
        Delta) for a plain time T0 below a drafting time D). So when it is at most 1, the bound
        check would rule drafting out at bs too, and re-running the policy would choose zeros
        again. Without it, a review found a shrink from 16 to 8 requests, the 8 that left with
        acceptance 0.05 and those that stayed with 0.9, where drafting then paid +26% and was
        found 127 steps late (ratio 0.79 at 16). Under churn at bs 16 (CPU machine, requests
        finishing and joining every few steps) shrink-triggered runs and the window resets they
        caused (before the thirty-eighth session) made the policy run on 0.083 of the steps,
        ~330 us a run."""
        ratio, margin = self.ratio, self.margin
        return (
            margin > 0
            and ratio is not None
            and ratio <= margin
            and 2 * bs >= self.bs
            and ratio * self.bs <= bs
        )

    def shrunk(self, bs: int) -> bool:
        """Whether a batch of bs requests is smaller than the one the last all-zero run saw
        (self.bs) by more than `shrink` of it (rounded down, so below 8 requests at the default
        1/8 any shrink counts). Under load the decode batch dips by a request or two nearly
        every step (requests finish; their successors join after their prefill), and when
        every dip re-ran the policy and reset its window, the policy ran on about a third of
        the steps at batch 64 (CPU machine, staggered requests; ~0.5 ms per run there). A dip
        that small barely changes what a step costs per request, so it waits for the recheck;
        a real shrink (a burst draining) still re-runs at once, unless the last run's bound
        shows that drafting cannot pay at the smaller batch either (far_from_paying)."""
        # + 1e-9: a fraction such as 0.29 of 100 is 28.999... in floating point, not 29
        cut = math.floor(self.bs * self.shrink + 1e-9)
        return bs < self.bs - cut and not self.far_from_paying(bs)

    def after_run(self, bs: int, drafted: bool, all_zero: bool, ratio: float | None) -> None:
        """A policy run on bs requests chose drafts (drafted), or all zeros as the goodput
        policy (all_zero, with its bound ratio `ratio`, None when the bound check did not
        decide): the window for what follows. Only drafting resets the window to
        recheck_every. A run that a shrink triggered and that chose zeros again keeps doubling
        it, as a shrink that far_from_paying lets pass keeps it without a run: that run has
        just judged the smaller batch. What changes before the next run (joins, which wait
        for the window as at any other time; each request's acceptance estimate drifting back
        to the prior while it does not draft, idle_accept_decay; the tokens left and the KV
        in use; the online step-time correction; a guard block expiring) is found at most
        recheck_max - 1 steps late, as after any all-zero run, and a further shrink past
        recheck_shrink still re-runs at once. What gets slower: such a change right after a
        shrink, which the reset found within 3-27 steps (with recheck_margin 0). With the
        reset, every request finishing below 8 requests restarted the window at 4 steps and
        cost 4-5 runs instead of one: at c = 2 on the H100 (thirty-eighth session) the policy
        ran on 4.0-4.4% of the steps with recheck_margin 0, 1.0-4.4% with 0.8."""
        self.ratio = ratio if all_zero else None
        if drafted:  # back to the shortest window
            self.window = self.every
            self.left = self.bs = 0
        elif all_zero:
            self.left, self.bs = self.window - 1, bs
            self.window = min(2 * self.window, self.max_window)
