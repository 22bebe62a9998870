"""The TokenizerManager's output side (main process): applies the scheduler's BatchStrOut messages
to each request's ReqState, reports finished requests to the metrics collector, and builds the
upstream-style output dicts ({"text", "output_ids", "meta_info"}) that /generate returns.

Functions, not a class: the TokenizerManager owns every piece of state (rid_to_state, the metrics
collector, the token-text cache) and passes it in; nothing here is kept between calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.managers.io_struct import BatchStrOut, SpecCounters, merge_spec, spec_meta


@dataclass
class ReqState:
    """Tokenizer-side state of one request (main process only). Created by
    TokenizerManager._submit (rid, prompt_tokens, return_logprob, created, text_in_logprobs);
    the output fields are set by handle_batch_out, `abandoned` by TokenizerManager.generate_request
    when the client leaves, `closed` by TokenizerManager.finish_all_local."""

    rid: str
    prompt_tokens: int
    return_logprob: bool
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    spec: SpecCounters | None = None  # a speculative server's counters (full_meta expands them)
    finished: bool = False
    # the client left before the end: the rid stays taken (a reuse is refused) until the
    # scheduler's final output for it arrives, so that no later request gets this one's outputs
    abandoned: bool = False
    # ended by TokenizerManager.finish_all_local (shutdown), not by the scheduler
    closed: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_time: float | None = None  # the scheduler's perf_counter() stamp
    last_token_time: float | None = None  # arrival of the latest output (ITL gaps)
    itls: list[float] = field(default_factory=list)  # per-token latencies after the first
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    text_in_logprobs: bool = False  # return_text_in_logprobs: fill each entry's token text


def handle_batch_out(
    rid_to_state: dict[str, ReqState], msg: BatchStrOut, metrics_collector: Any
) -> None:
    """Apply one BatchStrOut to the states of its requests and wake their waiters.

    rid_to_state: the TokenizerManager's in-flight requests; an abandoned request's entry is
    deleted here when its final output arrives (rids not in it are skipped). metrics_collector:
    a TokenizerMetricsCollector or None (then finished requests only get their e2e_latency).
    Raises what BatchStrOut.apply_text_delta or merge_spec raise (the caller logs it)."""
    now = time.perf_counter()
    for i, rid in enumerate(msg.rids):
        state = rid_to_state.get(rid)
        if state is None:
            continue
        if state.abandoned:  # nobody reads it; counted when the client left
            if msg.finished_reason[i] is not None:
                del rid_to_state[rid]  # the rid may be used again
            continue
        if state.finished:  # ended on this side (finish_all_local, at shutdown): its final
            continue  # output is out or on its way; a later one must not overwrite it
        if msg.output_ids_delta[i]:
            if state.first_token_time is None:
                # The scheduler's stamp: a non-streamed request's first delivery is its
                # last, so its arrival time would make TTFT the end-to-end latency.
                stamp = msg.first_token_time[i] if msg.first_token_time else None
                state.first_token_time = stamp if stamp is not None else now
            elif state.last_token_time is not None:
                # Per token, as upstream: a delivery of n tokens (a speculative step's
                # accepted drafts + bonus token) spreads its gap evenly over them.
                n = len(msg.output_ids_delta[i])
                state.itls.extend([(now - state.last_token_time) / n] * n)
            state.last_token_time = now
        state.text = msg.apply_text_delta(i, state.text)
        state.output_ids.extend(msg.output_ids_delta[i])
        state.meta = dict(msg.meta[i])
        if msg.spec:
            state.spec = merge_spec(state.spec, msg.spec[i])
        if state.return_logprob:
            state.output_token_logprobs.extend(msg.output_token_logprobs_delta[i] or [])
            state.output_top_logprobs.extend(msg.output_top_logprobs_delta[i] or [])
            if msg.input_token_logprobs[i] is not None:
                state.input_token_logprobs = msg.input_token_logprobs[i]
                state.input_top_logprobs = msg.input_top_logprobs[i]
        if msg.finished_reason[i] is not None:
            state.finished = True
            state.meta["finish_reason"] = msg.finished_reason[i]
            observe_finished(state, now, metrics_collector)
        state.event.set()


def close_all(rid_to_state: dict[str, ReqState], message: str, metrics_collector: Any) -> int:
    """Finish every unfinished request of rid_to_state here, with finish_reason {"type":
    "abort", "message": message} and `closed` set (its waiter then raises the 503 when it has
    sent nothing yet), and wake its waiter; abandoned ones (their client left) are deleted.
    Later scheduler outputs for them are dropped by handle_batch_out. Returns how many were
    ended (TokenizerManager.finish_all_local, at shutdown)."""
    now = time.perf_counter()
    ended = 0
    for rid, state in list(rid_to_state.items()):
        if state.finished:
            continue
        if state.abandoned:
            del rid_to_state[rid]
            continue
        state.finished = state.closed = True
        state.meta["finish_reason"] = {"type": "abort", "message": message}
        observe_finished(state, now, metrics_collector)
        state.event.set()
        ended += 1
    return ended


def observe_finished(state: ReqState, now: float, metrics_collector: Any) -> None:
    """Set state.meta["e2e_latency"] (seconds, `now` is a perf_counter() stamp) and report the
    request to metrics_collector.observe_request_finished unless the collector is None."""
    state.meta["e2e_latency"] = now - state.created
    if metrics_collector is None:
        return
    # No output token (prompt-only or aborted early): no time to first token.
    first = state.first_token_time
    meta = full_meta(state)
    metrics_collector.observe_request_finished(
        prompt_tokens=state.prompt_tokens,
        completion_tokens=len(state.output_ids),
        cached_tokens=state.meta.get("cached_tokens", 0),
        ttft_s=None if first is None else first - state.created,
        itls_s=state.itls,
        e2e_s=now - state.created,
        spec_accept_length=meta.get("spec_accept_length"),
        spec_mean_draft_len=meta.get("spec_mean_draft_len"),
    )


def full_meta(state: ReqState) -> dict:
    """The request's meta from the last message, with its speculative keys (spec_meta)
    expanded here rather than by the scheduler thread."""
    if state.spec is None:
        return state.meta
    return {**state.meta, **spec_meta(state.spec, len(state.output_ids))}


def build_output(state: ReqState, token_text: Callable[[int], str] | None = None) -> dict:
    """The request's output so far: {"text": str, "output_ids": list[int], "meta_info": dict}.
    With return_logprob, meta_info carries the (logprob, token_id, token_text) lists; token_text
    (one token id -> its text) fills their text, else it is None."""
    meta = {
        "id": state.rid,
        "finish_reason": None,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.output_ids),
        "cached_tokens": 0,
        **full_meta(state),
    }
    if state.return_logprob:
        meta["input_token_logprobs"] = _with_text(state.input_token_logprobs or [], token_text)
        meta["input_top_logprobs"] = [
            _with_text(t, token_text) for t in state.input_top_logprobs or []
        ]
        meta["output_token_logprobs"] = _with_text(state.output_token_logprobs, token_text)
        meta["output_top_logprobs"] = [_with_text(t, token_text) for t in state.output_top_logprobs]
    return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}


class TokenTextCache:
    """One token's text, as upstream's return_text_in_logprobs gives it (its
    tokenizer.batch_decode of single ids); cached per id (at most the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}  # token id -> tokenizer.decode([id])

    def __call__(self, tid: int) -> str:
        text = self.texts.get(tid)
        if text is None:
            text = self.texts[tid] = self.tokenizer.decode([tid])
        return text


def _with_text(pairs: list | None, text: Callable[[int], str] | None = None) -> list:
    """Upstream's logprob entries are (logprob, token_id, token_text); token_text is None
    unless the request set return_text_in_logprobs (then `text` decodes one token id)."""
    if pairs is None:
        return None
    if text is None:
        return [(lp, tid, None) for lp, tid in pairs]
    return [(lp, tid, text(tid)) for lp, tid in pairs]
