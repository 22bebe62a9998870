"""Typed messages between the tokenizer manager, the scheduler and the detokenizer.

GenerateReqInput is what a user sends (HTTP body of /generate or Engine.generate arguments);
TokenizedGenerateReqInput goes to the scheduler over ZMQ; BatchStrOut comes back.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """One request or a batch of requests (lists), as upstream's /generate accepts."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False

    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        if self.input_ids is None:
            raise ValueError("either 'text' or 'input_ids' must be given")
        return len(self.input_ids) == 0 or isinstance(self.input_ids[0], int)

    def batch_size(self) -> int:
        if self.is_single():
            return 1
        return len(self.text if self.text is not None else self.input_ids)

    def __getitem__(self, i: int) -> GenerateReqInput:
        """The i-th request of a batch as a single GenerateReqInput."""

        def pick(v: Any) -> Any:
            return v[i] if isinstance(v, list) else v

        sp = self.sampling_params
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=sp[i] if isinstance(sp, list) else sp,
            rid=self.rid[i] if isinstance(self.rid, list) else None,
            return_logprob=pick(self.return_logprob),
            logprob_start_len=pick(self.logprob_start_len),
            top_logprobs_num=pick(self.top_logprobs_num),
            return_text_in_logprobs=self.return_text_in_logprobs,
            stream=self.stream,
        )


def new_rid() -> str:
    return uuid.uuid4().hex


def list_of(v: Any, typ: type) -> bool:
    """v is a list whose items are all `typ` (a bool is no int)."""
    return isinstance(v, list) and all(isinstance(x, typ) and not isinstance(x, bool) for x in v)


def list_of_bools(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, bool) for x in v)


# The accepted types of GenerateReqInput's fields (single prompt or batch), checked before a
# request is split: by the HTTP server's /generate parser and by Engine.generate.
GENERATE_FIELD_TYPES: dict[str, Callable[[Any], bool]] = {
    "text": lambda v: isinstance(v, str) or list_of(v, str),
    "input_ids": lambda v: (
        list_of(v, int) or (list_of(v, list) and all(list_of(x, int) for x in v))
    ),
    "sampling_params": lambda v: isinstance(v, dict) or list_of(v, dict),
    "stream": lambda v: isinstance(v, bool),
    "return_logprob": lambda v: isinstance(v, bool) or list_of_bools(v),
    "return_text_in_logprobs": lambda v: isinstance(v, bool),
    "rid": lambda v: isinstance(v, str) or list_of(v, str),
}


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    stream: bool
    seed: int  # per-request random stream (sampling_seed if given, else drawn at random)


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    state: dict


# A speculative request's counters as sent per step: (verify steps, accepted drafts, proposed
# drafts, accept histogram: [k] = drafting steps that accepted k drafts; None when unchanged
# since the request's previous message, see merge_spec).
SpecCounters = tuple[int, int, int, tuple[int, ...] | None]


def merge_spec(previous: SpecCounters | None, new: SpecCounters) -> SpecCounters:
    """`new` with its histogram taken from `previous` when it carries none (the scheduler sends
    it only after it changed); still None when neither has one (never for a request's own
    messages, whose first one carries it). Never raises: it runs in the loop that delivers
    every request's outputs."""
    if new[3] is not None or previous is None:
        return new
    return (new[0], new[1], new[2], previous[3])


def spec_meta(counters: SpecCounters, completion_tokens: int) -> dict:
    """The meta_info keys of a request on a speculative server (upstream's spec_verify_ct and
    accept length, plus this fork's draft counters) from its SpecCounters (with a histogram:
    merge_spec) and its number of output tokens: spec_accept_length = output tokens / verify
    steps, spec_accept_rate = accepted / proposed drafts (0.0 before any), spec_mean_draft_len
    = proposed / verify steps (verify steps counted as at least 1)."""
    verify_ct, correct, proposed, histogram = counters
    ct = max(1, verify_ct)
    return {
        "spec_verify_ct": verify_ct,
        "spec_accept_length": completion_tokens / ct,
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_accept_histogram": list(histogram or ()),
        "spec_mean_draft_len": proposed / ct,
    }


@dataclass
class BatchStrOut:
    """Per-request increments produced in one scheduler step.

    For request rids[i]: output_ids_delta[i] new token ids; text[i] the decoded text (stop
    strings trimmed) from character text_offset[i] on: the full text so far is the text received
    before, cut to text_offset[i] characters, plus text[i] (apply_text_delta; no text_offset
    list: text[i] is the full text). Sending the new text only keeps each step's message small
    whatever the output length. finished_reason[i] None while running, else
    {"type": "stop"|"length"|"abort", "matched": ...}; meta[i] counters (prompt_tokens,
    completion_tokens, cached_tokens, ...). Logprob lists hold the new entries only.
    first_token_time[i] is the time.perf_counter() at which the scheduler committed the
    request's first output token (None before it): CLOCK_MONOTONIC on Linux, one clock for all
    processes of the host, so the tokenizer manager subtracts its own perf_counter() stamps.
    spec[i] (a speculative server's messages only; empty otherwise) is the request's
    SpecCounters; the receiver keeps the last histogram (merge_spec) and expands the counters
    into meta keys (spec_meta), so the scheduler thread sends three numbers per request and
    step (and the histogram after it changed) instead of building seven derived keys.
    """

    rids: list[str]
    text: list[str]
    output_ids_delta: list[list[int]]
    finished_reason: list[dict | None]
    meta: list[dict]
    output_token_logprobs_delta: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top_logprobs_delta: list[list | None] = field(default_factory=list)
    input_token_logprobs: list[list | None] = field(default_factory=list)
    input_top_logprobs: list[list | None] = field(default_factory=list)
    first_token_time: list[float | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    spec: list[SpecCounters] = field(default_factory=list)

    def apply_text_delta(self, i: int, previous: str) -> str:
        """The full text of request i after this message, given the text before it."""
        if not self.text_offset:
            return self.text[i]
        return previous[: self.text_offset[i]] + self.text[i]
