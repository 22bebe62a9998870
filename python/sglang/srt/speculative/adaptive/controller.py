"""AdaptiveController: what SpecScheduler calls when --speculative-adaptive is on.

It owns the acceptance estimates (AcceptanceTracker), the step-time model (StepTimeModel) and
the configured policy (registry), turns the running requests into a BatchView each decode step,
and learns from each committed verify step (measured forward time, per-request accepts).
Requests are duck-typed: `req_pool_idx`, `kv_len`, `draft.draft_kv_len` and `draft.stale` are
read (see spec_info.pending_positions).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sglang.srt.speculative.adaptive.acceptance import AcceptanceTracker
from sglang.srt.speculative.adaptive.drafting_report import DraftingReport
from sglang.srt.speculative.adaptive.goodput_guard import GoodputGuard
from sglang.srt.speculative.adaptive.policy import (
    BatchView,
    amortized_pending,
    drafting_steps_left,
    single_request_bound_rates,
    spread_steps,
)
from sglang.srt.speculative.adaptive.registry import AdaptiveConfig, build_policy
from sglang.srt.speculative.adaptive.step_time_model import (
    StepTimeModel,
    allocation_features,
    plain_step_features,
)
from sglang.srt.speculative.adaptive.step_timing import StepTiming
from sglang.srt.speculative.adaptive.zero_reuse import ZeroReuse
from sglang.srt.speculative.spec_info import pending_positions

logger = logging.getLogger(__name__)


class AdaptiveController:
    """Per-step draft lengths from the configured policy (K = k, num_slots request slots).

    defer_plain_steps: how many plain steps' observations may wait to be learnt from together
    (observe; 0: each is learnt from at once). The scheduler defers DEFER_PLAIN_STEPS.
    """

    def __init__(
        self, cfg: AdaptiveConfig, k: int, num_slots: int, defer_plain_steps: int = 0
    ) -> None:
        self.cfg = cfg
        self.defer_plain_steps = defer_plain_steps
        # plain steps observed but not learnt from yet, in commit order:
        # (batch size, KV tokens, forward seconds or None, step index, perf_counter at commit)
        self._deferred: list[tuple[int, int, float | None, int, float]] = []
        self.k = k
        self.policy = build_policy(cfg, k)
        self.tracker = AcceptanceTracker(
            k,
            num_slots,
            initial_accept=cfg.initial_accept,
            server_prior_count=cfg.server_prior_count,
            prior_strength=cfg.prior_strength,
            server_decay=cfg.server_accept_decay,
            request_decay=cfg.request_accept_decay,
            idle_decay=cfg.idle_accept_decay,
        )
        self.time_model = StepTimeModel(
            cfg.time_model,
            cfg.time_decay,
            cfg.time_prior_weight,
            cfg.online_correction,
            cfg.time_idle_decay,
        )
        # measured check of the policy (goodput only: the baselines do what they are told)
        self.guard = None
        if cfg.guard and self.policy.name == "goodput":
            self.guard = GoodputGuard(
                cfg.guard_margin, cfg.guard_min_steps, cfg.guard_backoff, cfg.guard_backoff_max
            )
        self.prev = np.full(num_slots, -1, dtype=np.int64)  # [num_slots] last d per slot
        # slots whose prev is not 0 (a plain step writes only these)
        self._prev_nonzero: set[int] = set(range(num_slots))
        # wall intervals between decode commits, the overhead EMA, which steps to time
        self.timing = StepTiming(cfg.count_overhead)
        self._drafting_run = 0  # consecutive committed steps that drafted (cfg.probe_every)
        self.num_probes = 0
        self._probe_left = 0  # plain steps still to run in the current probe (cfg.probe_len)
        # batch size of the last observed decode step if it drafted, else 0: a plain step
        # right after one runs unpipelined (the drafting step drained the overlap pipeline)
        # and costs what steady plain steps do not, so it is no sample of them but part of
        # what the drafting run cost (observe)
        self._run_bs = 0
        self.num_transition_steps = 0  # plain steps after a drafting step (no samples)
        self.drafting = DraftingReport()  # drafting steps per batch-size bucket
        self.last = {
            "bs": 0,
            "sum_d": 0,
            "x": None,
            "measured_s": 0.0,
            "forward_s": 0.0,
        }
        # when the goodput policy's last all-zero choice may be reused (reuse_zero)
        self.reuse = ZeroReuse(
            cfg.recheck_every, cfg.recheck_max, cfg.recheck_shrink, cfg.recheck_margin
        )
        self._all_zero = False  # the goodput policy's last run chose no drafts at all
        self.num_policy_runs = 0  # policy runs (choices not reused), for server info

    # ---------------------------------------------------------------- setup
    def on_admit(self, slot: int) -> None:
        """A new request took request slot `slot`."""
        self.flush_observations()  # the slot's row is synced to the step count
        self.tracker.reset_slot(slot)
        self.prev[slot] = -1
        self._prev_nonzero.add(slot)

    # ---------------------------------------------------------------- decide
    def time_fn(self, x: np.ndarray) -> np.ndarray:
        """Predicted seconds per step for features x [m, F]: wall time between consecutive
        decode commits with cfg.count_overhead, forward time otherwise (see observe)."""
        return self.time_model.predict(x)

    def reuse_zero(self, reqs: Sequence[Any]) -> bool:
        """True (and one reuse counted) when the goodput policy's last run chose all zeros,
        less than its reuse window ago, for a batch that has not shrunk since: the policy is
        not run this step (ZeroReuse, zero_reuse.py)."""
        return self.reuse.take(len(reqs))

    def drafting_off(self) -> bool:
        """True while speculation is off for the server: the goodput policy's last run chose
        d = 0 for every request (with cfg.defer_draft_extend). Until it drafts again, the
        scheduler runs like a server without speculation where it can: prefills defer their
        draft extend, and new requests may use cached prefixes that lack draft KV (their draft
        catches up over them when they draft; SpecScheduler.on_admit and
        takes_target_only_prefix). Never for the fixed and tier baselines, which do what they
        are configured to do."""
        return self._all_zero and self.cfg.defer_draft_extend

    def choose(
        self,
        reqs: Sequence[Any],
        caps: Sequence[int],
        remaining: Sequence[int] | None = None,
    ) -> list[int]:
        """Draft length per request, each in [0, caps[i]] (see reuse_zero, which callers
        check first). remaining: [n] tokens each request may still generate (output budget
        and context room), from which the goodput policy estimates the drafting steps over
        which it spreads a long catch-up (drafting_steps_left, amortized_pending; None: a
        full cfg.catchup_horizon for every request)."""
        self.flush_observations()
        if not reqs or max(caps) == 0:
            self.reuse.expire()
            return [0] * len(reqs)
        if self._probe_left > 0:  # the rest of a probe: plain steps, the policy not run
            self._probe_left -= 1
            return [0] * len(reqs)
        guard = self.guard
        ratio = None  # the bound ratio of this step's policy run (recheck_margin)
        if guard is not None and guard.blocks(len(reqs)):
            chosen = [0] * len(reqs)  # drafting delivered less at this batch size lately
        else:
            chosen = self._run_policy(reqs, caps, remaining)
            ratio = getattr(self.policy, "last_bound_ratio", None)  # goodput only
        self._all_zero = self.policy.name == "goodput" and not any(chosen)
        self.reuse.after_run(len(reqs), any(chosen), self._all_zero, ratio)
        if any(chosen):
            if self._probe_due() or (guard is not None and guard.needs_plain(len(reqs))):
                # Measure what not drafting costs now: without it an over-estimated plain
                # step is never corrected while the policy keeps drafting, and the guard has
                # no plain rate to hold the drafting steps against. A probe is a run of
                # cfg.probe_len plain steps: its first runs unpipelined after the drafting
                # step and is no sample (observe); a single plain step between drafting steps
                # costs about twice a pipelined one (H200, SmolLM2, bs 1: 2.2 against 0.8 ms),
                # which made drafting look as good as not drafting while it delivered 0.6x.
                self._drafting_run = 0
                self._probe_left = self.cfg.probe_len - 1
                self.num_probes += 1
                return [0] * len(reqs)
        return chosen

    def _run_policy(
        self, reqs: Sequence[Any], caps: Sequence[int], remaining: Sequence[int] | None
    ) -> list[int]:
        self.num_policy_runs += 1
        if (
            len(reqs) == 1
            and self.policy.name == "goodput"
            and self.prev[reqs[0].req_pool_idx] <= 0
            and self._single_rules_out(
                reqs[0], caps[0], None if remaining is None else remaining[0]
            )
        ):
            return [0]
        slots = [r.req_pool_idx for r in reqs]
        horizon = self.cfg.catchup_horizon
        pending = np.array([pending_positions(r) for r in reqs], dtype=np.int64)
        caps_a = np.asarray(caps, dtype=np.int64)
        alphas = self.tracker.alphas(slots)
        if remaining is None:
            steps = np.full(len(reqs), float(horizon))
        else:
            steps = drafting_steps_left(np.asarray(remaining), alphas, caps_a)
        view = BatchView(
            caps=caps_a,
            alphas=alphas,
            pending=amortized_pending(pending, steps, caps_a + 1, horizon),
            prev=self.prev[slots],
            kv_tokens=sum(r.kv_len for r in reqs),
            # beyond the K + 1 positions of the drafting graphs: spread as the positions are
            long_share=np.where(pending > self.k + 1, 1.0 / spread_steps(steps, horizon), 0.0),
        )
        if self.policy.name == "goodput":  # its bound check reads the last solve
            chosen = self.policy.choose(view, self.time_fn, self.time_model.predict_unsolved)
        else:
            chosen = self.policy.choose(view, self.time_fn)
        return chosen.tolist()

    def _single_rules_out(self, req: Any, cap: int, left: int | None) -> bool:
        """For a batch of one request (cap >= 1) whose last draft length was 0, or that is new
        (so the policy's hysteresis keeps nothing else): the goodput policy's bound check in
        plain Python (single_request_bound_rates). True when it rules drafting out: the
        policy's run then returns all zeros, with its bound ratio and rate set as that run
        would set them. False: nothing is decided, the numpy policy runs (the tracker row's
        idle decay is already applied, and applying it again changes nothing).

        Why: at c = 1 the policy runs once per reuse window, dozens of numpy calls on arrays
        of one row with the caches cold after the window's plain steps: 0.34 ms a run in the
        scheduler on the CPU machine, 0.07 this way (profile_commit_host.py --online,
        benchmark/results/commit_host_cpu.json, labels "s31 bs1 online calls"). Equal to the
        numpy check up to the rounding of sums taken in another order
        (test_single_request_bound_check_matches_the_policy)."""
        top, plain = single_request_bound_rates(
            self.tracker.alpha_row(req.req_pool_idx),
            cap,
            left,
            pending_positions(req),
            req.kv_len,
            self.k,
            self.cfg.catchup_horizon,
            self.time_model.predict_row,  # the bound check's model: the last solve's
        )
        if top > plain:
            return False
        row, plain_x = self.time_model.predict_row, plain_step_features(1, req.kv_len)
        self.policy.note_all_zero(top / plain, lambda: 1.0 / row(plain_x))
        return True

    def _probe_due(self) -> bool:
        """Only the goodput policy probes (the baselines do what they are configured to do),
        and only when the step-time model learns online."""
        probe = self.cfg.probe_every
        online = self.time_model.online and self.policy.name == "goodput"
        return bool(probe) and online and self._drafting_run >= probe

    # ---------------------------------------------------------------- learn
    def observe(
        self,
        reqs: Sequence[Any],
        draft_lens: Sequence[int],
        accepted: Sequence[int],
        forward_time_s: float | None,
        step_index: int,
    ) -> None:
        """Learn from one decode step, called before its results are committed (req.kv_len
        and req.draft still describe the step's input). step_index: the scheduler's forward
        step counter at the step's launch (ScheduleBatch.step_index), to tell consecutive decode
        steps (with overlap scheduling a commit comes after the next step's launch, or before
        it when the pipeline drains, so the counter at commit time would not do).
        forward_time_s: the step's forward time in seconds, or None when it was not timed
        (StepTiming.wants_forward_time): it then feeds neither the overhead EMA nor, without
        a wall interval to measure the step by, the step-time model and the guard.

        With defer_plain_steps, a plain step in a run of plain steps (nothing drafted before
        it, no request's last length to clear) is only recorded (batch size, KV tokens, times)
        and learnt from later, in order, by flush_observations: the same updates, run back to
        back instead of once per step between the scheduler's other work."""
        now = time.perf_counter()
        sum_d = int(sum(draft_lens))
        kv = sum(r.kv_len for r in reqs)
        if not sum_d and self._defers_plain(reqs):
            self._deferred.append((len(reqs), kv, forward_time_s, step_index, now))
            if len(self._deferred) >= self.defer_plain_steps:
                self.flush_observations()
            return
        self.flush_observations()
        self._learn(len(reqs), kv, reqs, draft_lens, accepted, forward_time_s, step_index, now)

    def _defers_plain(self, reqs: Sequence[Any]) -> bool:
        """Whether a plain step's observation may wait (see observe): the controller is set to
        defer, the previous step did not draft (so this one is no transition step), the last
        length of each of the step's requests is already 0 (nothing to clear), and no per-step
        debug line is logged."""
        if self.defer_plain_steps <= 0 or self._run_bs or logger.isEnabledFor(logging.DEBUG):
            return False
        nonzero = self._prev_nonzero
        return not nonzero or nonzero.isdisjoint(r.req_pool_idx for r in reqs)

    def flush_observations(self) -> None:
        """Learn from the deferred plain steps, in order (see observe). Called before anything
        that reads what they teach: the policy's choice, a new request's admission (its
        acceptance row is synced to the step count), a non-deferred observation, info()."""
        if not self._deferred:
            return
        pending, self._deferred = self._deferred, []
        for bs, kv, forward_time_s, step_index, now in pending:
            self._learn(bs, kv, None, None, None, forward_time_s, step_index, now)

    def _learn(
        self,
        bs: int,
        kv: int,
        reqs: Sequence[Any] | None,
        draft_lens: Sequence[int] | None,
        accepted: Sequence[int] | None,
        forward_time_s: float | None,
        step_index: int,
        now: float,
    ) -> None:
        """observe's updates for one step of bs requests holding kv KV tokens, committed at
        perf_counter `now`. reqs, draft_lens and accepted are None for a deferred plain step
        (every d_i and accept 0; only deferred while no request's last length needs clearing,
        so the requests themselves are not needed)."""
        sum_d = int(sum(draft_lens)) if draft_lens is not None else 0
        long_catch_up = False  # a request caught up over more than K + 1 positions
        if sum_d:
            pending = [pending_positions(r) for r in reqs]
            steady = self.k + 1
            long = [float(p > steady) for p in pending]  # paid in full by this step
            x = allocation_features(draft_lens, pending, kv, long)
            long_catch_up = any(q and d for q, d in zip(long, draft_lens, strict=True))
        else:  # the common step under load
            x = plain_step_features(bs, kv)
        # interval: wall time since the previous decode commit, when consecutive; measured:
        # what the step cost the server (StepTiming), None for an untimed step without one
        interval, measured = self.timing.measure(
            step_index, now, forward_time_s, not sum_d and not self._run_bs
        )
        consecutive = interval is not None
        # A plain step right after a drafting step: its cost is the switch's (the drafting
        # step drained the pipeline), not a steady plain step's, which the policy and the
        # guard compare drafting against; it is no plain sample of either. The model has no
        # feature for the switch; the guard charges it to the drafting run it ends (below),
        # so a policy that keeps switching is still judged by what it delivered.
        transition = consecutive and self._run_bs > 0 and not sum_d
        run_bs, self._run_bs = self._run_bs, bs if sum_d else 0
        self.num_transition_steps += transition
        # measured is None only for an untimed step without an interval (its predecessor's
        # commit observed no request): no sample. Drafting steps are always timed.
        if sum_d and measured is not None:
            # predicted with the last solve's coefficients (no re-solve on the step path)
            predicted = self.time_model.predict_unsolved(x)
            self.drafting.record(bs, draft_lens, accepted, predicted, measured)
        if not transition and measured is not None:
            self.time_model.update(x, measured)
        tokens = bs + (int(sum(accepted)) if accepted is not None else 0)
        if self.guard is not None:
            # The guard judges steady drafting: a step with a long catch-up pays a one-time
            # cost that the policy spreads over the request's next steps (catchup_horizon),
            # so it is left out of the guard's rates (the step still counts as a step). A
            # transition step is no plain sample either: the guard charges it to the drafting
            # run it ends (end_run), whose cost it is.
            sample = None if long_catch_up or transition else interval
            self.guard.observe(bs, sum_d > 0, tokens, sample)
            if transition:
                self.guard.end_run(run_bs, tokens, interval)
        self._drafting_run = self._drafting_run + 1 if sum_d else 0
        # (a plain step under load needs neither the slots; a deferred one has no request
        # in _prev_nonzero, which only on_admit, flushing first, and _learn change)
        if reqs is not None and (sum_d or self._prev_nonzero):
            slots = [r.req_pool_idx for r in reqs]
            self.tracker.observe(slots, draft_lens, accepted)
            self._set_prev(slots, draft_lens, sum_d)
        else:
            self.tracker.observe_idle()
        last = self.last  # the step's features: its predicted time is computed when reported
        last["bs"], last["sum_d"], last["x"] = bs, sum_d, x
        if measured is not None:
            last["measured_s"] = measured
        if forward_time_s is not None:
            last["forward_s"] = forward_time_s
        if logger.isEnabledFor(logging.DEBUG):
            predicted = self.time_model.predict_unsolved(x)
            logger.debug(
                "spec step: bs=%d sum_d=%d predicted=%.3fms measured=%.3fms forward=%.3fms "
                "overhead=%.3fms accept_len=%.2f",
                bs,
                sum_d,
                predicted * 1e3,
                math.nan if measured is None else measured * 1e3,
                math.nan if forward_time_s is None else forward_time_s * 1e3,  # nan: untimed
                self.timing.overhead_s * 1e3,
                tokens / max(1, bs),
            )

    def _set_prev(self, slots: list[int], draft_lens: Sequence[int], sum_d: int) -> None:
        """prev[slots] = draft_lens. On a plain step (sum_d == 0) only the slots whose prev is
        not already 0 are written: under load that is usually none, and no array is built."""
        nonzero = self._prev_nonzero
        if sum_d:
            self.prev[slots] = draft_lens
            for slot, d in zip(slots, draft_lens, strict=True):
                if d:
                    nonzero.add(slot)
                else:
                    nonzero.discard(slot)
        elif nonzero:
            stale = [slot for slot in slots if slot in nonzero]
            if stale:
                self.prev[stale] = 0
                nonzero.difference_update(stale)

    # ---------------------------------------------------------------- report
    def _last_predicted(self) -> float:
        """The model's time for the last observed step (seconds; 0 before any step), with the
        coefficients of the last solve (not re-solved for a report)."""
        x = self.last["x"]
        return 0.0 if x is None else self.time_model.predict_unsolved(x)

    def info(self) -> dict:
        """Server-info keys (for /get_server_info and the /metrics gauges)."""
        self.flush_observations()
        return {
            "spec_adaptive_policy": self.policy.name,
            "spec_predicted_step_time_s": self._last_predicted(),
            "spec_measured_step_time_s": self.last["measured_s"],
            "spec_forward_time_s": self.last["forward_s"],
            "spec_step_overhead_s": self.timing.overhead_s,
            "spec_zero_probes": self.num_probes,
            "spec_policy_runs": self.num_policy_runs,
            "spec_zero_bound_ratio": self.reuse.ratio,
            "spec_transition_steps": self.num_transition_steps,
            "spec_last_step_sum_draft_len": self.last["sum_d"],
            "spec_step_time_coef": self.time_model.coefficients(),
            # predicted with the coefficients of the model's last solve before each step
            "spec_drafting_by_bs": self.drafting.report(),
            "spec_server_accept_rate_per_position": self.tracker.server_alpha().tolist(),
            **(self.guard.info() if self.guard is not None else {}),
        }
