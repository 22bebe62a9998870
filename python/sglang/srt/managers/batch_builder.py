"""Builds each step's plan: which requests run, how many tokens each computes, and where their
KV goes (the scheduler's decision half; the worker only executes the ModelWorkerBatch).

With overlap scheduling the plan may be built while the previous step still runs: a request in
that step then starts at kv_len + inflight_kv, counts len(output_ids) + inflight_tokens outputs,
and its not-yet-known last token is a future placeholder. Plans that would need that token on
the CPU (penalties), drafts, or retraction first drain the in-flight step (scheduler.drain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang.srt.managers.schedule_batch import FinishReason, ModelWorkerBatch, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_CLIP,
    NEW_TOKEN_RATIO_DECAY,
    PrefillAdder,
    SchedulePolicy,
    remaining_new_tokens,
)
from sglang.srt.managers.tp_worker_overlap_thread import future_placeholder
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow

# Cached tokens a request admitted while speculation is off gives up (recomputes) so that its
# target-only prefix stops before the cache's first branch in it and its draft can catch up
# later (BatchBuilder.match_prefix). With a chat template, requests share the template and
# branch where the user turns differ, a few tokens into the turn: without the cut a request
# whose turn starts like an earlier one crossed that branch and never drafted (H200, SmolLM2,
# c = 64: 148-304 of 513 prefills per point, benchmark/results/paired_smollm2_h200_s36.json,
# `spec_stale_prefills`).
MAX_BRANCH_CUT = 16

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.radix_cache import TreeNode


def next_kv_start(req: Req) -> int:
    """First position the request's next step computes (after its in-flight steps)."""
    return req.kv_len + req.inflight_kv


def done_after_inflight(req: Req, context_len: int) -> bool:
    """The in-flight token reaches max_new_tokens or the context length: the request finishes
    when that step commits, so it must not be scheduled again."""
    if req.inflight_tokens == 0:
        return False
    n = len(req.output_ids) + req.inflight_tokens
    return (
        n >= req.sampling_params.max_new_tokens or req.seqlen + req.inflight_tokens >= context_len
    )


def needs_inflight_token(req: Req) -> bool:
    """Sampling the next token reads the in-flight token's value on the CPU (penalties build
    their count/seen tensors from output_ids)."""
    sp = req.sampling_params
    return req.inflight_tokens > 0 and (
        sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
    )


class BatchBuilder:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        sa = scheduler.server_args
        self.policy = SchedulePolicy(sa.schedule_policy, scheduler.tree_cache)
        self.chunk_size = sa.chunked_prefill_size
        self.chunking = self.chunk_size is not None and self.chunk_size > 0
        self.token_budget = (
            min(sa.max_prefill_tokens, self.chunk_size)
            if self.chunking
            else (sa.max_prefill_tokens)
        )
        self.max_running = sa.max_running_requests
        self._by_node: dict[int, list[Req]] | None = None  # chunk_end_tokens, per prefill batch
        self._continuing: Req | None = None
        # The last step's sampling rows when every one was greedy without logits processors:
        # (its requests, its SamplingBatchInfo), reused while the same requests decode on.
        self._greedy_info: tuple[list[Req], SamplingBatchInfo] | None = None

    # ---------------------------------------------------------------- choose
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_new_prefill_batch()
        if batch is not None:
            return batch
        return self.get_decode_batch()

    def inflight_new_reqs(self) -> list[Req]:
        """Requests of an in-flight prefill step (they join the running set at its commit)."""
        step = self.s.inflight
        if step is None or not step.batch.forward_mode.is_extend():
            return []
        return [r for r, f in zip(step.batch.reqs, step.batch.is_final_chunk, strict=True) if f]

    def chunk_end_tokens(self, node: TreeNode, end: int) -> list[int]:
        """Next tokens of the live requests (running, in flight, chunked) whose cached prefix
        ends at `node`, token `end`: a chunked request keeps using the tree's slot of its
        cached chunk's last position, whose draft entry depends on its own next token, which
        the tree does not hold, so a catch-up over that slot by a request continuing
        differently would overwrite it (first_branch_on_path's `ends`; a review helper's fuzz
        found the overwrite, test_branch_cut_fuzz.py). The requests are grouped by node once
        per prefill batch, when a target-only prefix first asks."""
        if self._by_node is None:
            s, step = self.s, self.s.inflight
            live = [*s.running, *(step.batch.reqs if step is not None else ())]
            for r in (s.chunked_req, self._continuing):  # the second: this batch continues it
                if r is not None:
                    live.append(r)
            by_node: dict[int, list[Req]] = {}
            for r in live:
                if r.last_node is not None:
                    by_node.setdefault(id(r.last_node), []).append(r)
            self._by_node = by_node
        out = []
        for r in self._by_node.get(id(node), ()):
            if len(r.prefix_indices) == end and end < r.seqlen:
                out += r.fill_ids_slice(end, end + 1)  # fill_ids[end]
        return out

    def running_reserve(self) -> int:
        ratio = self.s.new_token_ratio
        reqs = [*self.s.running, *self.inflight_new_reqs()]
        return sum(int(min(remaining_new_tokens(r), NEW_TOKEN_CLIP) * ratio) for r in reqs)

    def get_new_prefill_batch(self) -> ScheduleBatch | None:
        s = self.s
        self._by_node = None  # chunk_end_tokens' grouping, built on first use
        self._continuing = None  # the chunked request this batch continues, if any
        if not s.waiting_queue and s.chunked_req is None:
            return None
        if s.inflight is not None and not all(s.inflight.batch.is_final_chunk):
            return None  # a chunk is in flight: one chunked request at a time, continue it next
        num_running = len(s.running) + len(self.inflight_new_reqs())
        if num_running >= self.max_running and s.chunked_req is None:
            return None
        adder = PrefillAdder(
            token_budget=self.token_budget,
            available_kv=s.kv.available_with_eviction(),
            running_reserve=self.running_reserve(),
            free_req_slots=min(
                self.max_running - num_running, s.req_to_token_pool.available_size()
            ),
            new_token_ratio=s.new_token_ratio,
            chunking=self.chunking,
        )
        if s.chunked_req is not None:
            req = s.chunked_req
            if adder.try_add(req, req.kv_len) == 0:
                return None  # cannot progress the chunk this step; decode instead
            s.chunked_req, self._continuing = None, req
        for req in self.policy.order(list(s.waiting_queue)):
            prefix = self.match_prefix(req)
            # Locking the matched prefix makes it unevictable: count that before deciding.
            s.tree_cache.inc_lock_ref(req.last_node)
            adder.available_kv = s.kv.available_with_eviction() - sum(adder.extend_lens)
            if adder.try_add(req, len(prefix)) == 0:
                s.tree_cache.dec_lock_ref(req.last_node)
                req.last_node = None
                break
            s.waiting_queue.remove(req)
            self.admit(req, prefix)
            if adder.extend_lens[-1] < req.seqlen - req.kv_len:
                break  # a chunked request ends the batch
        if not adder.admitted:
            return None
        return self.prepare_extend(adder.admitted, adder.extend_lens)

    def match_prefix(self, req: Req) -> torch.Tensor:
        """Cached prefix slots usable by req: at least one token must be computed (to get its
        logits), and none of the prompt tokens whose logprobs were asked for. With speculation,
        the prefix stops where the cached draft KV does unless the scheduler's speculative half
        says the target's alone will do (SpecScheduler.takes_target_only_prefix)."""
        spec = self.s.spec
        draft_only = spec is not None and not spec.takes_target_only_prefix()
        ids = req.fill_ids  # a new list per access
        res = self.s.tree_cache.match_prefix(ids, draft_only=draft_only)
        limit = req.seqlen - 1
        if req.wants_input_logprobs():
            limit = min(limit, req.logprob_start_len)
        n = len(res.device_indices)
        req.prefix_shares_branch = False
        if spec is not None and 0 < n <= res.draft_valid_len and res.last_node.children:
            # The draft KV of position n - 1 was computed with the token that follows it in
            # the cache, not req's (which differs, or the match would go on): recompute it.
            limit = min(limit, n - 1)
        elif spec is not None and n > res.draft_valid_len:
            # A target-only prefix (speculation is off): req's draft catches up over it later
            # (SpecScheduler.on_admit), and the catch-up's entry at the last position depends
            # on the token after it, req's own: computing that position in req's own slot
            # keeps the catch-up from overwriting what a request sharing the slot wrote there.
            limit = min(limit, n - 1)
            # The same holds inside the prefix where the cache branches: there req cannot
            # catch up without overwriting another branch's entry. A branch at most
            # MAX_BRANCH_CUT tokens before the prefix's end moves the end back to it (req
            # recomputes those tokens and can draft later); an earlier one keeps the prefix
            # and req never drafts.
            e = self.s.tree_cache.first_branch_on_path(
                res.last_node, n, res.draft_valid_len, limit, self.chunk_end_tokens, ids
            )
            if e is not None and limit - (e - 1) <= MAX_BRANCH_CUT:
                limit = e - 1
            else:
                req.prefix_shares_branch = e is not None
        req.last_node = res.last_node
        req.prefix_draft_valid_len = min(res.draft_valid_len, limit)
        return res.device_indices[:limit]

    def admit(self, req: Req, prefix: torch.Tensor) -> None:
        """Give a waiting request its request slot and its cached prefix (already locked)."""
        s = self.s
        req.req_pool_idx = s.req_to_token_pool.alloc(1)[0]
        req.prefix_indices = prefix
        s.kv.assign_slots(req, 0, prefix)
        req.kv_len = len(prefix)
        if s.spec is not None:
            s.spec.on_admit(req)
        if req.num_retractions == 0:
            req.cached_tokens = len(prefix)
            s.stats["prompt_tokens"] += len(req.origin_input_ids)
            s.stats["cached_tokens"] += len(prefix)

    def prepare_extend(self, reqs: list[Req], extend_lens: list[int]) -> ScheduleBatch:
        s = self.s
        slots = s.kv.alloc_tokens(sum(extend_lens))
        assert slots is not None, "admission checked the KV budget"
        s.kv.assign_slots_many(reqs, [r.kv_len for r in reqs], list(extend_lens), slots)
        for req, n in zip(reqs, extend_lens, strict=True):
            req.extend_input_len = n
        s.stats["prefill_steps"] += 1
        s.stats["prefill_reqs"] += len(reqs)
        s.stats["prefill_tokens"] += sum(extend_lens)
        final = [r.kv_len + n == r.seqlen for r, n in zip(reqs, extend_lens, strict=True)]
        return ScheduleBatch(
            reqs=reqs,
            forward_mode=ForwardMode.EXTEND,
            is_final_chunk=final,
            extend_lens=list(extend_lens),
            out_cache_loc=slots,
        )

    def get_decode_batch(self) -> ScheduleBatch | None:
        """One decode step for every running request: 1 + d_i tokens each (d_i = 0 without
        speculation). Under memory pressure drafts are dropped first, then requests retracted.

        While a step is in flight, requests whose in-flight token ends them are left out, and a
        plan that drafts, applies penalties to an in-flight request or must retract drains the
        in-flight step first (then the whole choice starts over)."""
        s = self.s
        reqs = [r for r in s.running if not done_after_inflight(r, s.model_config.context_len)]
        if not reqs:
            return None
        # Drains that do not depend on the drafts come before the choice: a choice thrown
        # away by the plan that starts over would still have counted (one of a zero probe's
        # plain steps, AdaptiveController.choose: under penalties every step drains and a
        # probe of 4 ran 2; a reused all-zero choice, reuse_zero), and cost a policy run.
        if s.inflight is not None and (
            any(needs_inflight_token(r) for r in reqs) or s.kv.available_with_eviction() < len(reqs)
        ):
            s.drain()
            return self.get_next_batch_to_run()
        lens = s.spec.choose_draft_lens(reqs) if s.spec else [0] * len(reqs)
        if s.inflight is not None and any(lens):
            s.drain()
            return self.get_next_batch_to_run()
        if s.kv.available_with_eviction() < len(reqs) + sum(lens):
            lens = [0] * len(reqs)
        if s.kv.available_with_eviction() < len(reqs) and s.chunked_req is not None:
            self.retract_chunked_req()  # (nothing is in flight here)
        if s.kv.available_with_eviction() < len(reqs):  # (nothing is in flight here)
            retracted = s.kv.retract_for(s.running, len)
            for req in retracted:
                s.running.remove(req)
            self.requeue(retracted)
            reqs = list(s.running)
            lens = [0] * len(reqs)
            if s.kv.available_with_eviction() < len(reqs):
                # A single request larger than the whole pool: finish it where it is.
                req = s.running.pop()
                req.finished_reason = FinishReason("length", message="KV cache is full")
                s.outputs.finish(req)
                return self.get_decode_batch()
        else:
            s.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, s.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        slots = s.kv.alloc_tokens(len(reqs) + sum(lens))
        s.kv.assign_slots_many(reqs, [next_kv_start(r) for r in reqs], [1 + d for d in lens], slots)
        for req, d in zip(reqs, lens, strict=True):
            req.extend_input_len = 1 + d
            req.draft_len = d
        mode = ForwardMode.TARGET_VERIFY if any(lens) else ForwardMode.DECODE
        return ScheduleBatch(
            reqs=reqs,
            forward_mode=mode,
            is_final_chunk=[True] * len(reqs),
            extend_lens=[1 + d for d in lens],
            out_cache_loc=slots,
        )

    def retract_chunked_req(self) -> None:
        """Put the half-prefilled request (scheduler.chunked_req) back at the head of the
        waiting queue: its computed chunks go to the prefix cache, unlocked, so eviction can
        free them for the running requests' next decode step. It goes before any running
        request (upstream retracts only running requests, but there a chunked request's KV is
        also the first to go: it has no output yet, and its chunks are a prefix hit when it is
        admitted again if they were not evicted meanwhile). Its prompt logprobs, if asked
        for, are recomputed from the first position (Req.reset_for_retract)."""
        s = self.s
        req, s.chunked_req = s.chunked_req, None
        s.kv.release(req)
        req.reset_for_retract()
        self.requeue([req])

    def requeue(self, reqs: list[Req]) -> None:
        """Retracted requests (KV released) back at the head of the waiting queue, in order,
        except those an abort came for while one of their steps was in flight (to_abort): they
        end here, as the abort of a waiting request does (Scheduler.abort_request), instead of
        waiting to be admitted again only to be dropped. Each counts as a retraction and makes
        admission more cautious (new_token_ratio + 0.1)."""
        s = self.s
        s.stats["num_retractions"] += len(reqs)
        s.new_token_ratio = min(1.0, s.new_token_ratio + 0.1 * len(reqs))
        keep = []
        for req in reqs:
            if req.to_abort:
                req.finished_reason = FinishReason("abort", message="aborted by request")
                s.outputs.emit(req)
            else:
                keep.append(req)
        s.waiting_queue[:0] = keep

    # ---------------------------------------------------------------- plan
    def build_model_worker_batch(self, batch: ScheduleBatch) -> ModelWorkerBatch:
        s = self.s
        input_ids: list[int] = []
        slots: list[np.ndarray] = []  # per request its KV slots, when the batch has none yet
        num_rows: list[int] = []
        targets: list[list[int]] = []
        num_future = 0  # input ids that are the in-flight token of their request
        for req, final in zip(batch.reqs, batch.is_final_chunk, strict=True):
            start, n = next_kv_start(req), req.extend_input_len
            ids = req.fill_ids_slice(start, start + n)
            if req.inflight_tokens and len(ids) < n and start + len(ids) == req.seqlen:
                ids.append(future_placeholder(req.req_pool_idx))  # the in-flight token
                num_future += 1
            input_ids.extend(ids + [0] * (n - len(ids)))  # draft tokens are filled by the worker
            if batch.out_cache_loc is None:
                slots.append(s.kv.req_slots_np(req, start, start + n))
            if batch.forward_mode == ForwardMode.EXTEND:
                tgt = self.input_logprob_targets(req, start, n, final)
                num_rows.append(len(tgt) + (1 if final else 0))
            else:  # decode / verify: every computed token gets a logits row
                tgt = []
                num_rows.append(n)
            targets.append(tgt)
        sampled = [r for r, f in zip(batch.reqs, batch.is_final_chunk, strict=True) if f]
        info = self.sampling_info(sampled) if sampled else None
        mwb = ModelWorkerBatch(
            forward_mode=batch.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device="cpu"),
            out_cache_loc=(
                torch.from_numpy(np.concatenate(slots))
                if batch.out_cache_loc is None
                else batch.out_cache_loc
            ),
            req_pool_indices=[r.req_pool_idx for r in batch.reqs],
            seq_lens=[next_kv_start(r) + r.extend_input_len for r in batch.reqs],
            extend_prefix_lens=[next_kv_start(r) for r in batch.reqs],
            extend_seq_lens=[r.extend_input_len for r in batch.reqs],
            num_logit_rows=num_rows,
            sample=list(batch.is_final_chunk),
            input_logprob_targets=targets,
            sampling_info=info,
            return_logprob=any(r.return_logprob for r in batch.reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in batch.reqs],
            has_future_ids=num_future > 0,
            all_future_ids=num_future == len(batch.reqs) == len(input_ids),
        )
        if s.spec is not None:
            mwb.spec = s.spec.build_plan(batch)
        return mwb

    def sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        """Sampling rows; an in-flight token counts as generated (random position and
        min_new_tokens). Its value is never read: requests whose sampling would read it
        (needs_inflight_token) are planned only after a drain.

        When the same requests as the last step's decode on and all of them were greedy with
        no logits processor, the last step's info is returned as is: such rows only take the
        argmax (their random positions are never read, and min_new_tokens, once inactive,
        stays so), and their tensors are never written. This saves building and uploading
        the rows every decode step (a third of a batch-1 step's host time in the seventh
        session's py-spy profile). Upstream keeps its SamplingBatchInfo across decode steps
        for the same reason."""
        cached = self._greedy_info
        if (
            cached is not None
            and len(cached[0]) == len(reqs)
            and all(a is b for a, b in zip(cached[0], reqs, strict=True))
        ):
            return cached[1]
        info = self._build_sampling_info(reqs)
        reuse = info.is_all_greedy and not info.has_logits_processors
        self._greedy_info = (list(reqs), info) if reuse else None
        return info

    def _build_sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        mc = self.s.model_config
        rows = []
        for r in reqs:
            assert not needs_inflight_token(r), "penalties need the in-flight token: drain first"
            rows.append(
                SamplingRow(
                    r.sampling_params, r.origin_input_ids, r.output_ids, r.seed, r.inflight_tokens
                )
            )
        return SamplingBatchInfo.from_rows(
            rows, mc.vocab_size, self.s.tp_worker.device, mc.eos_token_ids
        )

    @staticmethod
    def input_logprob_targets(req: Req, start: int, n: int, final: bool) -> list[int]:
        """Prompt tokens scored this step: row at position t scores prompt token t + 1, for
        t in [max(start, logprob_start_len), start + n), excluding the sampling row."""
        if not req.wants_input_logprobs() or start >= len(req.origin_input_ids):
            return []
        first = max(start, req.logprob_start_len)
        last = start + n - (1 if final else 0)  # exclusive
        return req.origin_input_ids[first + 1 : last + 1]
