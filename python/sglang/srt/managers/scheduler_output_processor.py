"""Commit half of a step: append the worker's tokens to each request, check stop conditions on
every new token, release finished requests' KV, and stream outputs to the tokenizer manager.

Overlap scheduling: a request may finish (stop token, stop string, abort) while a later step
that includes it is already running. Its KV is then released only when that step commits; the
step's token for it is discarded and the step's KV slots freed (`settle_inflight`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer
from sglang.srt.managers.io_struct import BatchStrOut
from sglang.srt.managers.schedule_batch import (
    FinishReason,
    GenerationBatchResult,
    Req,
    ScheduleBatch,
)

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler


class OutputProcessor:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.pending: list[Req] = []  # requests with something to send this step
        self.local_outbox: list[Any] = []  # used when the scheduler runs without IPC (tests)

    def init_detokenizer(self, req: Req) -> None:
        sp = req.sampling_params
        req.detok = IncrementalDetokenizer(
            self.s.tokenizer,
            prompt_ids_tail=req.origin_input_ids[-4:],
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )

    # ---------------------------------------------------------------- launch / settle
    @staticmethod
    def on_launch(batch: ScheduleBatch) -> None:
        """A step was handed to the worker: count it as in flight for its requests."""
        if not batch.extend_lens:
            batch.extend_lens = [r.extend_input_len for r in batch.reqs]
        for req, n, final in zip(batch.reqs, batch.extend_lens, batch.is_final_chunk, strict=True):
            req.inflight_steps += 1
            req.inflight_kv += n
            req.inflight_tokens += int(final)

    def settle_inflight(self, batch: ScheduleBatch) -> list[bool]:
        """The step is being committed: returns [bs] whether each request is still live.

        A request that finished while this (its oldest in-flight) step ran gets nothing from
        it: the step's KV slots are freed, and once no step of it is in flight any more its
        KV is released (prefix cache insertion included)."""
        live = []
        for req, n, final in zip(batch.reqs, batch.extend_lens, batch.is_final_chunk, strict=True):
            req.inflight_steps -= 1
            req.inflight_kv -= n
            req.inflight_tokens -= int(final)
            if not req.finished():
                live.append(True)
                continue
            live.append(False)
            self.s.stats["overlap_discarded_tokens"] += int(final)
            if req.req_pool_idx is not None:
                self.s.kv.free_token_range(req, req.kv_len, req.kv_len + n)
                if req.inflight_steps == 0:
                    self.s.kv.release(req)
        return live

    # ---------------------------------------------------------------- commit
    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        s = self.s
        live = self.settle_inflight(batch)
        if result.spec is not None:
            if not all(live):
                keep = [i for i, x in enumerate(live) if x]
                batch, result = subset_step(batch, result, keep)
            if batch.reqs:
                s.spec.commit_decode(batch, result)
            s.running = [r for r in s.running if not r.finished()]
            return
        for i, req in enumerate(batch.reqs):
            if not live[i]:
                continue
            start = req.kv_len
            req.kv_len += batch.extend_lens[i]
            req.extend_input_len = 0
            if s.spec is not None:
                s.spec.commit_extend(req, start, batch.is_final_chunk[i], result, i)
            if result.input_token_logprobs is not None and req.wants_input_logprobs():
                self.add_input_logprobs(req, result, i)
            if not batch.is_final_chunk[i]:
                # Mid-prompt chunk: share what is computed so far through the prefix cache.
                pending = s.spec.pending_slots(req) if s.spec is not None else None
                idx, node = s.tree_cache.cache_unfinished_req(
                    req.req_pool_idx,
                    req.fill_ids[: req.kv_len],
                    req.last_node,
                    req.draft_valid_len(),
                )
                req.prefix_indices, req.last_node = idx, node
                if s.spec is not None:  # the rewritten row's draft KV may be valid for less
                    valid = s.tree_cache.path_draft_valid_len(node, req.kv_len)
                    s.spec.limit_draft_kv(req, valid, pending, idx)
                s.chunked_req = req
                continue
            if req.sampling_params.max_new_tokens == 0:  # prompt only (e.g. prompt logprobs)
                req.finished_reason = FinishReason("length", matched=None)
                self.finish(req)
                continue
            lp = result.next_token_logprobs[i] if result.next_token_logprobs else None
            top = result.next_top_logprobs[i] if result.next_top_logprobs else None
            self.commit_tokens(req, [result.next_token_ids[i]], [lp], [top])
            if req.finished():
                self.finish(req)
            elif batch.forward_mode.is_extend() and req not in s.running:
                s.running.append(req)
        s.running = [r for r in s.running if not r.finished()]

    def commit_tokens(
        self,
        req: Req,
        token_ids: list[int],
        logprobs: list[float | None],
        top_logprobs: list[Any],
    ) -> int:
        """Append tokens one at a time, stopping at the first that finishes the request.

        Returns how many were appended. Used by plain decode (one token) and by speculative
        verify (the accepted run plus the bonus token). The caller settles the KV and then
        calls finish() for a finished request.
        """
        appended = 0
        if req.first_token_time is None and token_ids:
            req.first_token_time = time.perf_counter()
        for tok, lp, top in zip(token_ids, logprobs, top_logprobs, strict=True):
            # Text length before this token: only stop strings and stop-token trimming read it
            # (reading it decodes; otherwise the request's text is decoded when it is sent).
            needs_text = bool(req.sampling_params.stop_strs) or self.is_stop_token(req, tok)
            prev_text_len = len(req.detok.text) if needs_text else 0
            req.output_ids.append(tok)
            req.detok.append([tok])
            if req.return_logprob:
                req.output_token_logprobs.append((lp, tok))
                req.output_top_logprobs.append(top)
            appended += 1
            self.check_finished(req, prev_text_len)
            if req.finished():
                break
        if not req.finished() and req.stream:
            self.mark(req)
        return appended

    def is_stop_token(self, req: Req, tok: int) -> bool:
        """tok is one of the request's stop_token_ids, or an EOS id unless ignore_eos."""
        sp = req.sampling_params
        if tok in (sp.stop_token_ids or ()):
            return True
        return not sp.ignore_eos and tok in self.s.model_config.eos_token_ids

    def check_finished(self, req: Req, prev_text_len: int) -> None:
        """Stop token / stop string first (so a stop completed by the last allowed token is
        still trimmed and reported as "stop"), then max_new_tokens and the context length."""
        sp = req.sampling_params
        tok = req.output_ids[-1]
        if len(req.output_ids) >= sp.min_new_tokens:
            if self.is_stop_token(req, tok):
                req.finished_reason = FinishReason("stop", matched=tok)
                if not sp.no_stop_trim:
                    req.text_limit = prev_text_len
                return
            if sp.stop_strs:
                hit = req.detok.find_stop(sp.stop_strs, prev_text_len)
                if hit is not None:
                    idx, matched = hit
                    req.finished_reason = FinishReason("stop", matched=matched)
                    if not sp.no_stop_trim:
                        req.text_limit = idx
                    return
        if (
            len(req.output_ids) >= sp.max_new_tokens
            or req.seqlen >= self.s.model_config.context_len
        ):
            req.finished_reason = FinishReason("length", matched=None)

    def add_input_logprobs(self, req: Req, result: GenerationBatchResult, i: int) -> None:
        if not req.input_token_logprobs:  # upstream: the first scored token has logprob None
            req.input_token_logprobs.append((None, req.origin_input_ids[req.logprob_start_len]))
            req.input_top_logprobs.append(None)
        start = len(req.input_token_logprobs) + req.logprob_start_len
        for j, lp in enumerate(result.input_token_logprobs[i]):
            req.input_token_logprobs.append((lp, req.origin_input_ids[start + j]))
        req.input_top_logprobs.extend(result.input_top_logprobs[i])

    # ---------------------------------------------------------------- finish / abort
    def finish(self, req: Req) -> None:
        """Release a finished request's KV (deferred to settle_inflight while a step that
        includes it is in flight) and queue its final output."""
        if req.text_limit is None:
            req.detok.flush()  # emit bytes held back for an incomplete character
        if req.req_pool_idx is not None and req.inflight_steps == 0:
            self.s.kv.release(req)
        self.mark(req)

    def drop_aborted(self) -> None:
        s = self.s
        for req in [*s.running, s.chunked_req]:
            if req is not None and req.to_abort and not req.finished():
                req.finished_reason = FinishReason("abort", message="aborted by request")
                self.finish(req)
        s.running = [r for r in s.running if not r.finished()]
        if s.chunked_req is not None and s.chunked_req.finished():
            s.chunked_req = None

    # ---------------------------------------------------------------- send
    def mark(self, req: Req) -> None:
        if not self.pending or self.pending[-1] is not req:
            if req not in self.pending:
                self.pending.append(req)

    def emit(self, req: Req) -> None:
        self.mark(req)
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        out = BatchStrOut([], [], [], [], [])
        for req in self.pending:
            self.append_output(out, req)
        self.pending = []
        self.s.send(out)

    def append_output(self, out: BatchStrOut, req: Req) -> None:
        new_ids = req.output_ids[req.sent_output_len :]
        req.sent_output_len = len(req.output_ids)
        out.rids.append(req.rid)
        text = req.detok.text
        if req.text_limit is not None:
            text = text[: req.text_limit]
        elif not req.finished() and req.sampling_params.stop_strs:
            text = text[: len(text) - stop_prefix_holdback(text, req.sampling_params.stop_strs)]
        prev = req.sent_text
        if text.startswith(prev):  # the usual case: only the new text crosses the process
            out.text.append(text[len(prev) :])
            out.text_offset.append(len(prev))
        else:  # never expected (sent text is never withdrawn): resend it whole
            out.text.append(text)
            out.text_offset.append(0)
        req.sent_text = text
        out.output_ids_delta.append(new_ids)
        out.first_token_time.append(req.first_token_time)
        out.finished_reason.append(req.finished_reason.to_json() if req.finished() else None)
        out.meta.append(
            {
                "prompt_tokens": len(req.origin_input_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
            }
        )
        if self.s.spec is not None:
            out.spec.append(self.s.spec.counters(req))
        if req.return_logprob:
            k = req.sent_logprob_len
            out.output_token_logprobs_delta.append(req.output_token_logprobs[k:])
            out.output_top_logprobs_delta.append(req.output_top_logprobs[k:])
            req.sent_logprob_len = len(req.output_token_logprobs)
            first = k == 0
            out.input_token_logprobs.append(req.input_token_logprobs if first else None)
            out.input_top_logprobs.append(req.input_top_logprobs if first else None)
        else:
            for lst in (
                out.output_token_logprobs_delta,
                out.output_top_logprobs_delta,
                out.input_token_logprobs,
                out.input_top_logprobs,
            ):
                lst.append(None)


def subset_step(
    batch: ScheduleBatch, result: GenerationBatchResult, keep: list[int]
) -> tuple[ScheduleBatch, GenerationBatchResult]:
    """The rows `keep` of a committed step (speculative results: per-request lists)."""

    def pick(xs: list | None) -> list | None:
        return None if xs is None else [xs[i] for i in keep]

    sub = ScheduleBatch(
        reqs=pick(batch.reqs),
        forward_mode=batch.forward_mode,
        is_final_chunk=pick(batch.is_final_chunk),
        extend_lens=pick(batch.extend_lens),
        step_index=batch.step_index,
    )
    spec = result.spec
    spec = dataclasses.replace(
        spec, **{f.name: pick(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    )
    res = dataclasses.replace(
        result,
        next_token_ids=pick(result.next_token_ids),
        next_token_logprobs=pick(result.next_token_logprobs),
        next_top_logprobs=pick(result.next_top_logprobs),
        spec=spec,
    )
    return sub, res


def stop_prefix_holdback(text: str, stop_strs: list[str]) -> int:
    """Characters at the end of `text` that could begin a stop string (the longest suffix of
    text that is a proper prefix of one of stop_strs). A running request's streamed text stops
    before them, so text that a later stop trims is never sent (upstream does the same)."""
    hold = 0
    for s in stop_strs:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
