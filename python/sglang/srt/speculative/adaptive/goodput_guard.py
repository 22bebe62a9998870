"""GoodputGuard: a measured check of the goodput policy's claim that drafting pays.

The goodput policy drafts when its step-time model and acceptance estimates predict more
committed tokens per second than a plain step. The model is linear in a few features and is
corrected online, but a cost it has no feature for (e.g. a drafting step draining the overlap
pipeline at a batch size the warm-up sweep never saw) can keep it wrong, and then speculation
makes the server slower, which issue 7 rules out. The guard compares what was delivered:
committed tokens per wall second of consecutive decode steps (the same wall intervals the
controller learns from; plain steps: an EMA of their tokens over an EMA of their seconds,
drafting steps: total tokens over total seconds of the current trial), for steps that drafted
and steps that did not, per batch-size bucket (bs.bit_length(): 1, 2-3, 4-7, ..., 128-255,
...). When a bucket's drafting steps delivered less than (1 - margin) x its plain steps' rate,
by more than Z standard errors of the trial's rate, over at least `min_steps` drafting and
`min_steps // 2` plain samples (the controller runs plain steps to get them when the bucket
has none: needs_plain), drafting is blocked for batches of that bucket for `backoff`
observed steps; each further failure doubles the block (up to `backoff_max`), a trial that
holds up resets it. After a block the bucket's drafting statistics start over, so the next
trial is judged on its own steps.

This is this fork's addition, not upstream behaviour (upstream's adaptive speculation switches
by batch-size tiers without measuring).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sglang.srt.speculative.adaptive.drafting_report import bs_bucket_name

logger = logging.getLogger(__name__)

EMA = 0.1  # weight of a new plain step in the plain tokens and seconds
STALL = 3.0  # a plain step counts as at most this many times its tokens' seconds at the plain rate
# A trial blocks drafting only when its rate is below the plain bar by more than Z standard
# errors: one-sided, a drafting trial that truly delivers the bar trips ~2% of the time (a
# 16-step trial at acceptance 0.95, K = 4, spreads 1.21-1.56 tokens/ms around 1.41).
Z = 2.0


@dataclass
class _Bucket:
    # steps without drafts: EMAs of their tokens and wall seconds, whose ratio is the plain
    # rate. Not an EMA of each step's tokens / seconds: 1 / s is convex, so uneven intervals
    # of steps that cost the same (a commit that waits on the next launch's host work is late
    # and the next one early) inflate such an average, 16% for intervals alternating 0.5 and
    # 1.1 ms, which blocked drafting that delivered 7% more than plain steps (the drafting
    # side is a ratio of sums too).
    plain_t: float = 0.0
    plain_s: float = 0.0
    plain_n: int = 0
    # drafting steps since the last verdict (the trial): sums of their tokens t_i, wall
    # seconds s_i, t_i^2, s_i^2 and t_i s_i, for the ratio estimate sum t / sum s and its
    # standard error (an EMA started at its first sample let one unlucky step, 1 token where
    # 4.5 was the mean, weigh 0.2 in a 16-step verdict)
    draft_n: int = 0
    t: float = 0.0
    s: float = 0.0
    tt: float = 0.0
    ss: float = 0.0
    ts: float = 0.0
    last_t: float = 0.0  # the trial's last drafting sample (a transition joins it: end_run)
    last_s: float = 0.0
    blocked_until: int = 0  # observed-step index until which drafting is blocked
    backoff: int = 0  # length of the next block (0: the initial backoff)

    def add_draft(self, tokens: int, seconds: float) -> None:
        self.draft_n += 1
        self.t += tokens
        self.s += seconds
        self.tt += tokens * tokens
        self.ss += seconds * seconds
        self.ts += tokens * seconds
        self.last_t, self.last_s = tokens, seconds

    def add_to_last(self, tokens: int, seconds: float) -> None:
        """Fold tokens and seconds into the trial's last sample (its sums of squares too)."""
        t0, s0 = self.last_t, self.last_s
        t1, s1 = t0 + tokens, s0 + seconds
        self.t += tokens
        self.s += seconds
        self.tt += t1 * t1 - t0 * t0
        self.ss += s1 * s1 - s0 * s0
        self.ts += t1 * s1 - t0 * s0
        self.last_t, self.last_s = t1, s1

    def plain_rate(self) -> float:
        """Tokens/s of the recent steps without drafts (0 before any)."""
        return self.plain_t / self.plain_s if self.plain_s > 0 else 0.0

    def reset_draft(self) -> None:
        self.draft_n = 0
        self.t = self.s = self.tt = self.ss = self.ts = 0.0

    def draft_rate(self) -> tuple[float, float]:
        """(tokens/s of the trial's drafting steps, its standard error): the ratio estimator
        R = sum t / sum s with Var(R) ~= sum (t_i - R s_i)^2 / (n (n - 1) mean(s)^2)."""
        n = self.draft_n
        if n == 0 or self.s <= 0:
            return 0.0, 0.0
        r = self.t / self.s
        if n < 2:
            return r, 0.0
        resid = max(0.0, self.tt - 2 * r * self.ts + r * r * self.ss)
        mean_s = self.s / n
        return r, (resid / (n * (n - 1))) ** 0.5 / mean_s


class GoodputGuard:
    """Per batch-size bucket rates of drafting and plain decode steps, and blocks of drafting
    where it delivered less.

    Args:
        margin: drafting must deliver at least (1 - margin) x the plain rate, in [0, 1).
        min_steps: drafting samples before a verdict (plain: min_steps // 2, at least 1).
        backoff: observed steps of the first block.
        backoff_max: longest block.
    """

    def __init__(self, margin: float, min_steps: int, backoff: int, backoff_max: int) -> None:
        self.margin = margin
        self.min_steps = min_steps
        self.min_plain = max(1, min_steps // 2)
        self.backoff = backoff
        self.backoff_max = max(backoff, backoff_max)
        self.buckets: dict[int, _Bucket] = {}
        self.now = 0  # observed steps
        self.num_trips = 0  # verdicts that blocked drafting

    def _bucket(self, bs: int) -> _Bucket:
        key = bs.bit_length()
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket()
        return b

    def blocks(self, bs: int) -> bool:
        """True while drafting is blocked for a batch of bs requests."""
        b = self.buckets.get(bs.bit_length())
        return b is not None and self.now < b.blocked_until

    def needs_plain(self, bs: int) -> bool:
        """True when a batch of bs requests should run one plain step to give the guard a
        plain rate: its bucket has a verdict's worth of drafting samples but fewer plain ones
        than a verdict needs (e.g. a server that drafted from its first request on)."""
        b = self.buckets.get(bs.bit_length())
        return b is not None and b.draft_n >= self.min_steps and b.plain_n < self.min_plain

    def observe(self, bs: int, drafted: bool, tokens: int, seconds: float | None) -> None:
        """One decode step of bs requests that committed `tokens` tokens; seconds: its wall
        interval since the previous decode commit, or None when the previous step was not a
        decode step right before it (no sample, only the step count advances)."""
        self.now += 1
        if seconds is None or not seconds > 0:
            return
        b = self._bucket(bs)
        if not drafted:
            w = 1.0 if b.plain_n == 0 else EMA
            if b.plain_n:
                # A stall (a GC pause, a slow poll) counts as at most STALL x what the step's
                # tokens take at the current plain rate: in the EMA of seconds a 100 ms stall
                # among 0.8 ms steps cut the rate to 0.28x for 15 samples and passed drafting
                # at 0.8x. Plain steps of one bucket differ far less than that.
                seconds = min(seconds, STALL * tokens * b.plain_s / b.plain_t)
            b.plain_t += w * (tokens - b.plain_t)
            b.plain_s += w * (seconds - b.plain_s)
            b.plain_n += 1
            return
        b.add_draft(tokens, seconds)
        if b.draft_n < self.min_steps or b.plain_n < self.min_plain:
            return
        rate, se = b.draft_rate()
        plain = b.plain_rate()
        trips = rate + Z * se < (1.0 - self.margin) * plain
        logger.debug(
            "spec guard: bs=%d drafting %.0f +- %.0f tok/s over %d steps, plain %.0f tok/s "
            "(%d samples): %s",
            bs,
            rate,
            se,
            b.draft_n,
            plain,
            b.plain_n,
            "block" if trips else "keep",
        )
        if trips:
            block = b.backoff or self.backoff
            b.blocked_until = self.now + block
            b.backoff = min(2 * block, self.backoff_max)
            self.num_trips += 1
        else:
            b.backoff = 0
        b.reset_draft()  # the next trial is judged on its own steps

    def end_run(self, bs: int, tokens: int, seconds: float | None) -> None:
        """A plain step (`tokens` tokens, `seconds` its wall interval) right after a drafting
        step of bs requests: a transition, which runs unpipelined because the drafting step
        drained the overlap pipeline, so it costs what leaving the drafting run costs. It is no
        plain sample (observe gets it without seconds) and joins the run's last drafting
        sample in the bucket's trial: for a bar of p tokens/s, the trial's (T + t) / (S + s)
        < p exactly when T / (S + s - t / p) < p, i.e. the run's tokens over its seconds plus
        the transition's excess over a plain step at rate p. Left out, a policy that drafts
        every other step passed every trial at 1.41 tokens/ms against 1.25 while delivering
        1.02 (test_guard_charges_the_switch_back_to_the_drafting_run). Dropped when the trial
        has no sample yet (a verdict was just taken on that run)."""
        b = self.buckets.get(bs.bit_length())
        if b is None or b.draft_n == 0 or seconds is None or not seconds > 0:
            return
        b.add_to_last(tokens, seconds)

    def info(self) -> dict:
        """Server-info keys: trips so far and the buckets blocked now (as 'lo-hi' batch sizes)."""
        blocked = sorted(k for k, b in self.buckets.items() if self.now < b.blocked_until)
        return {
            "spec_guard_trips": self.num_trips,
            "spec_guard_blocked_bs": [bs_bucket_name(k) for k in blocked],
        }
