"""The scheduler's speculative-decoding half: per-request draft lengths for each step, the
SpecPlan of a ModelWorkerBatch, and committing verify results (accepted tokens, KV of rejected
drafts freed at once, draft state for the next step).

All state lives on the scheduler's Req objects (req.draft is an EagleDraftInput); the worker
only executes the plan. Draft length has one home per level: --speculative-num-steps (server
default K), sampling param max_draft_tokens (per-request cap), req.draft_len (this step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang.srt.managers.io_struct import SpecCounters
from sglang.srt.managers.schedule_batch import GenerationBatchResult, Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.adaptive import AdaptiveController, parse_adaptive_config
from sglang.srt.speculative.adaptive.warmup import profile_on_worker
from sglang.srt.speculative.spec_info import EagleDraftInput, SpecPlan, pending_positions

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler

# Positions a request may lag its draft by (decoded or prefilled without drafting): its next
# drafting step's catch-up extends the draft over all of them. Beyond this the request stops
# speculating for good instead of paying for a longer catch-up.
MAX_PENDING_HIDDEN = 1024
# Plain steps whose observations the adaptive controller may learn from together
# (AdaptiveController.observe): the same updates, run back to back instead of between each
# step's other host work (bs 1, CPU machine: the adaptive commit's excess over a plain one 16.9
# -> 9.9 us per step, benchmark/results/commit_host_cpu.json, labels "s30").
DEFER_PLAIN_STEPS = 16


class SpecScheduler:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.num_steps = scheduler.server_args.speculative_num_steps  # K
        self.stats = {
            "spec_verify_steps": 0,  # request-steps in decode
            "spec_committed_tokens": 0,  # tokens committed by those steps
            "spec_drafting_steps": 0,  # request-steps with d > 0
            "spec_proposed_drafts": 0,
            "spec_accepted_drafts": 0,
            "spec_last_step_share_drafting": 0.0,
            "spec_deferred_draft_extends": 0,  # prefill chunks whose draft extend was deferred
            "spec_prefill_draft_extends": 0,  # prefill chunks whose draft extend ran
            "spec_stale_prefills": 0,  # prefill chunks of requests that can never draft
        }
        self.accept_histogram = [0] * (self.num_steps + 1)
        # whether the last plan built (= the last step launched) was a decode step where every
        # d_i = 0: the next plain step's commit then follows it directly (time_forward)
        self._last_plain_decode = False
        sa = scheduler.server_args
        self.adaptive = (  # --speculative-adaptive: per-step draft lengths from a policy
            AdaptiveController(
                parse_adaptive_config(sa.speculative_adaptive_config),
                self.num_steps,
                scheduler.req_to_token_pool.size,
                defer_plain_steps=DEFER_PLAIN_STEPS,
            )
            if sa.speculative_adaptive
            else None
        )
        if self.adaptive is not None and sa.device == "cuda":  # CPU: no warm-up sweep
            profile_on_worker(scheduler, self.adaptive)

    # ---------------------------------------------------------------- lifecycle
    def on_new_request(self, req: Req) -> None:
        req.draft = EagleDraftInput()
        req.spec_accept_histogram = [0] * (self.num_steps + 1)

    def on_admit(self, req: Req) -> None:
        """The cached prefix carries valid draft KV for its first req.prefix_draft_valid_len
        tokens. A longer prefix (taken while speculation is off, takes_target_only_prefix)
        leaves the rest pending: the target's hidden states of those positions are the pool
        rows of the prefix's slots (written when the cache's owner computed them), so the
        request's first drafting step catches its draft up over them, unless the lag exceeds
        MAX_PENDING_HIDDEN (it then never drafts). Such a prefix stops one position short
        (BatchBuilder.match_prefix): the draft KV of its last position depends on the token
        after it, which is req's own, so req computes that position in a slot of its own,
        and its catch-up writes into shared slots only entries every sharer computes alike;
        where the cache branches inside the pending part (req.prefix_shares_branch) no
        catch-up can, and req never drafts."""
        valid = min(req.kv_len, req.prefix_draft_valid_len)
        req.draft.draft_kv_len = valid
        if req.kv_len - valid > MAX_PENDING_HIDDEN or (
            valid < req.kv_len and req.prefix_shares_branch
        ):
            req.draft.stale = True
        if self.adaptive is not None:
            self.adaptive.on_admit(req.req_pool_idx)

    def pending_slots(self, req: Req) -> np.ndarray | None:
        """[kv_len - draft_kv_len] KV slots of req's pending positions (a copy), or None when
        its draft can never catch up (stale). Taken before a prefill chunk is cached, for
        limit_draft_kv."""
        d = req.draft
        if d.stale:
            return None
        return self.s.req_to_token_pool.read_np(req.req_pool_idx, d.draft_kv_len, req.kv_len).copy()

    def limit_draft_kv(
        self,
        req: Req,
        valid: int,
        pending_before: np.ndarray | None = None,
        row: torch.Tensor | None = None,
    ) -> None:
        """req's prefill chunk was cached and its row now holds the tree's slots (`row`, [kv_len]
        int64 CPU), whose draft KV is valid for the first `valid` positions only: it stops
        drafting for good unless its draft KV already ended there, and also when one of its
        pending positions (`pending_before`: their slots before, from pending_slots) was
        moved to a slot the tree shares. (A catch-up over such a slot would write its draft
        KV with req's next token, over the entry of a request that shares the slot and
        continues differently: e.g. the position a target-only prefix left to req, BatchBuilder
        .match_prefix, which the cache swaps back to its own slot.)"""
        d = req.draft
        if valid < d.draft_kv_len:
            d.draft_kv_len = valid
            d.stale = True
        elif pending_before is not None and row is not None and not d.stale:
            now = row[d.draft_kv_len : d.draft_kv_len + len(pending_before)].numpy()
            if not np.array_equal(now, pending_before.astype(now.dtype)):
                d.stale = True

    def takes_target_only_prefix(self) -> bool:
        """Whether new requests may take cached prefixes without valid draft KV (and prefills
        may defer their draft extend): while the adaptive controller keeps choosing no drafts
        at all (AdaptiveController.drafting_off), as a server without speculation would."""
        return self.adaptive is not None and self.adaptive.drafting_off()

    def defers_draft_extend(self, req: Req, n: int) -> bool:
        """Whether req's prefill chunk of n tokens skips the draft extend and leaves its n
        positions pending instead (their hidden states stay in the pool; the catch-up of its
        first drafting step consumes them, as for positions decoded without drafting).
        Deferred while speculation is off, up to MAX_PENDING_HIDDEN // 2 positions (a longer
        prompt runs its draft extend, so that it can still decode that many steps without
        drafting before it would stop drafting for good); and always once a request's draft
        lags (an extend would build on draft KV it lacks), up to MAX_PENDING_HIDDEN
        positions, beyond which it stops drafting for good."""
        d = req.draft
        pending = pending_positions(req)
        if not pending and not self.takes_target_only_prefix():
            return False
        limit = MAX_PENDING_HIDDEN if pending else MAX_PENDING_HIDDEN // 2
        if pending + n <= limit:
            return True
        if pending:
            d.stale = True
        return False

    # ---------------------------------------------------------------- decide
    def draft_len_cap(self, req: Req, left: int | None = None) -> int:
        """Largest useful d for req this step: K, the request's max_draft_tokens, the tokens it
        may still generate (minus the bonus token) and its context room; 0 for a request that
        cannot draft (stale, or lagging its draft by more than MAX_PENDING_HIDDEN positions:
        it then becomes stale). left: tokens_left(req), when the caller has it."""
        d = req.draft
        if d.stale:
            return 0
        if pending_positions(req) > MAX_PENDING_HIDDEN:
            d.stale = True
            return 0
        return self.length_cap(req, left)

    def length_cap(self, req: Req, left: int | None = None) -> int:
        """draft_len_cap(req) if its draft state allowed drafting: what K, max_draft_tokens,
        the remaining tokens and the context room leave (left: tokens_left(req), when the
        caller has it)."""
        sp = req.sampling_params
        cap = self.num_steps
        if sp.max_draft_tokens is not None:
            cap = min(cap, sp.max_draft_tokens)
        if left is None:
            left = self.tokens_left(req)
        return max(0, min(cap, left - 1))

    def tokens_left(self, req: Req) -> int:
        """Tokens req may still generate: its output budget and its context room."""
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
        return min(remaining, self.s.model_config.context_len - req.seqlen)

    def choose_draft_lens(self, reqs: list[Req]) -> list[int]:
        """Every request drafts its cap, or (--speculative-adaptive) what the policy picks
        within the caps."""
        a = self.adaptive
        if a is not None and a.reuse_zero(reqs):
            return [0] * len(reqs)
        left = [self.tokens_left(r) for r in reqs]  # each request's, read once per step
        caps = [self.draft_len_cap(r, n) for r, n in zip(reqs, left, strict=True)]
        if a is None:
            return caps
        if not any(caps) and a.drafting_off():
            # Nobody can draft (e.g. all took target-only prefixes while speculation was off):
            # the policy still decides whether drafting would pay at their length caps, else
            # it would never run again and speculation would stay off for good.
            a.choose(reqs, [self.length_cap(r, n) for r, n in zip(reqs, left, strict=True)], left)
            return caps
        return a.choose(reqs, caps, left)

    # ---------------------------------------------------------------- plan
    def build_plan(self, batch: ScheduleBatch) -> SpecPlan:
        kv = self.s.kv
        if batch.forward_mode == ForwardMode.EXTEND:
            ext, keep = [], []
            for req, final in zip(batch.reqs, batch.is_final_chunk, strict=True):
                start, n = req.kv_len, req.extend_input_len
                deferred = not req.draft.stale and self.defers_draft_extend(req, n)
                keep.append(deferred)
                self.stats["spec_deferred_draft_extends"] += deferred
                if deferred or req.draft.stale:  # a stale draft is never read again
                    self.stats["spec_stale_prefills"] += req.draft.stale
                    ext.append([])
                    continue
                self.stats["spec_prefill_draft_extends"] += 1
                e = n - 1 if final else n
                ext.append(req.fill_ids_slice(start + 1, start + 1 + e))
            self._last_plain_decode = False
            return SpecPlan(
                draft_lens=[0] * len(batch.reqs), draft_extend_ids=ext, draft_keep_rows=keep
            )
        plan = SpecPlan(draft_lens=[r.draft_len for r in batch.reqs])
        plain = not any(plan.draft_lens)
        plan.time_forward = self.adaptive is not None and self.adaptive.timing.wants_forward_time(
            plain, self._last_plain_decode
        )
        self._last_plain_decode = plain
        if plain:  # a plain step: no catch-up lists (nothing reads them)
            return plan
        for req in batch.reqs:
            if req.draft_len > 0:
                lo, n = req.draft.draft_kv_len, req.kv_len
                plan.catchup_ids.append(req.fill_ids_slice(lo + 1, n + 1))
                plan.catchup_prefix_lens.append(lo)
                plan.catchup_slots.append(kv.req_slots_np(req, lo, n))
            else:
                plan.catchup_ids.append([])
                plan.catchup_prefix_lens.append(0)
                plan.catchup_slots.append(None)
        return plan

    # ---------------------------------------------------------------- commit
    def commit_extend(
        self, req: Req, start: int, final: bool, result: GenerationBatchResult, i: int
    ) -> None:
        """After a prefill chunk: the draft extend covered the chunk (but its last position
        when final, whose hidden state stays pending until the first draft step), or,
        deferred, all the chunk's positions stay pending (their hidden states are in the
        pool either way)."""
        d = req.draft
        if d.stale:
            return
        keep = result.draft_keep_rows
        if keep is not None and keep[i]:
            return
        d.draft_kv_len = req.kv_len - (1 if final else 0)

    def commit_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """Commit a decode step's accepted runs. The positions a request committed without
        drafting stay pending (their hidden states are the pool rows of their KV slots);
        a drafting request's catch-up consumed its pending positions up to the step's
        input."""
        s, spec = self.s, result.spec
        if self.adaptive is not None:  # before commit: reqs still describe the step's input
            lens = [r.draft_len for r in batch.reqs]
            fwd = result.forward_time_s if result.forward_timed else None
            self.adaptive.observe(batch.reqs, lens, spec.num_accepted, fwd, batch.step_index)
        drafting = committed = 0
        out = s.outputs
        logprobs = spec.logprobs
        for i, req in enumerate(batch.reqs):
            n, dlen = req.kv_len, req.draft_len
            toks = spec.tokens[i]
            if logprobs is not None:
                lps, tops = logprobs[i], spec.top_logprobs[i]
            else:
                lps = tops = [None] * len(toks)
            appended = out.commit_tokens(req, toks, lps, tops)
            req.kv_len = n + appended
            req.extend_input_len = req.draft_len = 0
            committed += appended
            req.spec_verify_ct += 1
            if dlen > 0:
                # KV is valid for x_n and the appended tokens but the last; free the rest now.
                s.kv.free_token_range(req, n + appended, n + 1 + dlen)
                self.record_drafting(req, dlen, spec.num_accepted[i])
                drafting += 1
                req.draft.draft_kv_len = n  # the catch-up consumed the pending positions
            if req.finished():
                out.finish(req)
        st = self.stats
        st["spec_verify_steps"] += len(batch.reqs)
        st["spec_committed_tokens"] += committed
        st["spec_last_step_share_drafting"] = drafting / max(1, len(batch.reqs))

    def record_drafting(self, req: Req, dlen: int, accepted: int) -> None:
        """Counters of a request-step that proposed dlen > 0 drafts."""
        req.spec_num_proposed_drafts += dlen
        req.spec_num_correct_drafts += accepted
        req.spec_accept_histogram[accepted] += 1
        req.spec_histogram_sent = False
        self.accept_histogram[accepted] += 1
        st = self.stats
        st["spec_drafting_steps"] += 1
        st["spec_proposed_drafts"] += dlen
        st["spec_accepted_drafts"] += accepted

    # ---------------------------------------------------------------- report
    @staticmethod
    def counters(req: Req) -> SpecCounters:
        """What a request's output message carries about its speculation (io_struct.spec_meta
        turns it into meta_info keys on the receiving side). The accept histogram goes only
        when it changed since the last message (a drafting step), else None: the receiver
        keeps the last one (io_struct.merge_spec)."""
        histogram = None
        if not req.spec_histogram_sent:
            histogram = tuple(req.spec_accept_histogram)
            req.spec_histogram_sent = True
        return (
            req.spec_verify_ct,
            req.spec_num_correct_drafts,
            req.spec_num_proposed_drafts,
            histogram,
        )

    def server_info(self) -> dict:
        st = self.stats
        return {
            **st,
            "avg_spec_accept_length": st["spec_committed_tokens"] / max(1, st["spec_verify_steps"]),
            "spec_accept_histogram": list(self.accept_histogram),
            "spec_mean_draft_len": st["spec_proposed_drafts"] / max(1, st["spec_verify_steps"]),
            **(self.adaptive.info() if self.adaptive is not None else {}),
        }
