"""Builds each step's plan: which requests run, how many tokens each computes, and where their
KV goes (the scheduler's decision half; the worker only executes the ModelWorkerBatch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler


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

    # ---------------------------------------------------------------- choose
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_new_prefill_batch()
        if batch is not None:
            return batch
        return self.get_decode_batch()

    def running_reserve(self) -> int:
        ratio = self.s.new_token_ratio
        return sum(
            int(min(remaining_new_tokens(r), NEW_TOKEN_CLIP) * ratio) for r in self.s.running
        )

    def get_new_prefill_batch(self) -> ScheduleBatch | None:
        s = self.s
        if not s.waiting_queue and s.chunked_req is None:
            return None
        if len(s.running) >= self.max_running and s.chunked_req is None:
            return None
        adder = PrefillAdder(
            token_budget=self.token_budget,
            available_kv=s.kv.available_with_eviction(),
            running_reserve=self.running_reserve(),
            free_req_slots=min(
                self.max_running - len(s.running), s.req_to_token_pool.available_size()
            ),
            new_token_ratio=s.new_token_ratio,
            chunking=self.chunking,
        )
        if s.chunked_req is not None:
            req = s.chunked_req
            if adder.try_add(req, req.kv_len) == 0:
                return None  # cannot progress the chunk this step; decode instead
            s.chunked_req = None
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
        logits), and none of the prompt tokens whose logprobs were asked for."""
        res = self.s.tree_cache.match_prefix(req.fill_ids)
        limit = req.seqlen - 1
        if req.wants_input_logprobs():
            limit = min(limit, req.logprob_start_len)
        req.last_node = res.last_node
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
        offset = 0
        for req, n in zip(reqs, extend_lens, strict=True):
            s.kv.assign_slots(req, req.kv_len, slots[offset : offset + n])
            req.extend_input_len = n
            offset += n
        final = [r.kv_len + n == r.seqlen for r, n in zip(reqs, extend_lens, strict=True)]
        return ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, is_final_chunk=final)

    def get_decode_batch(self) -> ScheduleBatch | None:
        """One decode step for every running request: 1 + d_i tokens each (d_i = 0 without
        speculation). Under memory pressure drafts are dropped first, then requests retracted."""
        s = self.s
        if not s.running:
            return None
        lens = s.spec.choose_draft_lens(s.running) if s.spec else [0] * len(s.running)
        if s.kv.available_with_eviction() < len(s.running) + sum(lens):
            lens = [0] * len(s.running)
        if s.kv.available_with_eviction() < len(s.running):
            retracted = s.kv.retract_for(s.running, len)
            for req in retracted:
                s.running.remove(req)
            s.waiting_queue[:0] = retracted
            s.stats["num_retractions"] += len(retracted)
            s.new_token_ratio = min(1.0, s.new_token_ratio + 0.1 * len(retracted))
            lens = [0] * len(s.running)
            if s.kv.available_with_eviction() < len(s.running):
                # A single request larger than the whole pool: finish it where it is.
                req = s.running.pop()
                req.finished_reason = FinishReason("length", message="KV cache is full")
                s.outputs.finish(req)
                return self.get_decode_batch()
        else:
            s.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, s.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        slots = s.kv.alloc_tokens(len(s.running) + sum(lens))
        offset = 0
        for req, d in zip(s.running, lens, strict=True):
            s.kv.assign_slots(req, req.kv_len, slots[offset : offset + 1 + d])
            req.extend_input_len = 1 + d
            req.draft_len = d
            offset += 1 + d
        reqs = list(s.running)
        mode = ForwardMode.TARGET_VERIFY if any(lens) else ForwardMode.DECODE
        return ScheduleBatch(reqs=reqs, forward_mode=mode, is_final_chunk=[True] * len(reqs))

    # ---------------------------------------------------------------- plan
    def build_model_worker_batch(self, batch: ScheduleBatch) -> ModelWorkerBatch:
        s = self.s
        input_ids: list[int] = []
        slots: list[torch.Tensor] = []
        num_rows: list[int] = []
        targets: list[list[int]] = []
        for req, final in zip(batch.reqs, batch.is_final_chunk, strict=True):
            start, n = req.kv_len, req.extend_input_len
            ids = req.fill_ids[start : start + n]
            input_ids.extend(ids + [0] * (n - len(ids)))  # draft tokens are filled by the worker
            slots.append(s.kv.req_slots(req, start, start + n))
            if batch.forward_mode == ForwardMode.EXTEND:
                tgt = self.input_logprob_targets(req, start, n, final)
                num_rows.append(len(tgt) + (1 if final else 0))
            else:  # decode / verify: every computed token gets a logits row
                tgt = []
                num_rows.append(n)
            targets.append(tgt)
        sampled = [r for r, f in zip(batch.reqs, batch.is_final_chunk, strict=True) if f]
        info = (
            SamplingBatchInfo.from_reqs(
                sampled, s.model_config.vocab_size, s.tp_worker.device, s.model_config.eos_token_ids
            )
            if sampled
            else None
        )
        mwb = ModelWorkerBatch(
            forward_mode=batch.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            out_cache_loc=torch.cat(slots),
            req_pool_indices=[r.req_pool_idx for r in batch.reqs],
            seq_lens=[r.kv_len + r.extend_input_len for r in batch.reqs],
            extend_prefix_lens=[r.kv_len for r in batch.reqs],
            extend_seq_lens=[r.extend_input_len for r in batch.reqs],
            num_logit_rows=num_rows,
            sample=list(batch.is_final_chunk),
            input_logprob_targets=targets,
            sampling_info=info,
            return_logprob=any(r.return_logprob for r in batch.reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in batch.reqs],
        )
        if s.spec is not None:
            mwb.spec = s.spec.build_plan(batch)
        return mwb

    @staticmethod
    def input_logprob_targets(req: Req, start: int, n: int, final: bool) -> list[int]:
        """Prompt tokens scored this step: row at position t scores prompt token t + 1, for
        t in [max(start, logprob_start_len), start + n), excluding the sampling row."""
        if not req.wants_input_logprobs() or start >= len(req.origin_input_ids):
            return []
        first = max(start, req.logprob_start_len)
        last = start + n - (1 if final else 0)  # exclusive
        return req.origin_input_ids[first + 1 : last + 1]
