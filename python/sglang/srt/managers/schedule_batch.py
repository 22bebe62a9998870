"""Request state (Req), the scheduler's batch (ScheduleBatch) and its plan for one step
(ModelWorkerBatch).

Ownership: every field here is written by the scheduler process only. The model worker reads a
ModelWorkerBatch and returns a GenerationBatchResult; it never edits a Req, never allocates or
frees KV, and never writes req_to_token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams


class FinishReason:
    """Why a request ended; `to_json()` is upstream's meta_info["finish_reason"]."""

    def __init__(
        self,
        type_: str,
        matched: int | str | None = None,
        message: str | None = None,
        status_code: int | None = None,
    ):
        self.type = type_  # "stop" | "length" | "abort"
        self.matched = matched
        self.message = message
        # an abort the HTTP layer answers with this status (upstream: 503 for a full queue)
        self.status_code = status_code

    def to_json(self) -> dict:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


class Req:
    """One generation request as the scheduler tracks it.

    Token layout: fill_ids = origin_input_ids + output_ids. The KV of fill_ids[:kv_len] is in
    the pool at req_to_token[req_pool_idx, :kv_len]; the last output token's KV is written by
    the next step (it is that step's input).
    """

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        input_text: str | None = None,
    ) -> None:
        self.rid = rid
        self.input_text = input_text
        self.origin_input_ids = origin_input_ids  # prompt token ids
        self.output_ids: list[int] = []  # generated token ids (committed)
        self.sampling_params = sampling_params
        self.seed = seed  # per-request random stream
        self.stream = stream
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num

        # Memory (scheduler-owned)
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # tokens of fill_ids whose KV is in the pool
        self.prefix_indices = torch.empty(0, dtype=torch.int64, device="cpu")  # radix prefix slots
        self.last_node: Any = None  # radix node locked by this request
        # leading tokens of the matched prefix whose draft KV is valid too (speculation)
        self.prefix_draft_valid_len = 0
        # the target-only part of the matched prefix crosses a point where the cache branches
        # (BatchBuilder.match_prefix): its draft cannot catch up over it
        self.prefix_shares_branch = False
        self.cached_tokens = 0  # prompt tokens served from the radix cache (reported)

        # This step's plan
        self.extend_input_len = 0  # tokens computed this step
        self.draft_len = 0  # speculative draft tokens verified this step (d_i)

        # Overlap scheduling: launched steps of this request not committed yet, the KV positions
        # they add and the tokens they sample (the next step starts at kv_len + inflight_kv and
        # counts len(output_ids) + inflight_tokens outputs; see tp_worker_overlap_thread.py)
        self.inflight_steps = 0
        self.inflight_kv = 0
        self.inflight_tokens = 0

        # Speculative decoding (None when off): draft state and per-request statistics
        self.draft: Any = None  # EagleDraftInput
        self.spec_verify_ct = 0  # decode (verify) forward passes
        self.spec_num_proposed_drafts = 0
        self.spec_num_correct_drafts = 0
        self.spec_accept_histogram: list[int] = []  # [k] steps that accepted k drafts (d > 0)
        self.spec_histogram_sent = False  # the last output message carried the histogram

        # Lifecycle
        self.finished_reason: FinishReason | None = None
        self.to_abort = False
        self.num_retractions = 0
        self.detok: Any = None  # IncrementalDetokenizer (scheduler process)
        self.text_limit: int | None = None  # output text is cut here (stop string / token)
        self.sent_output_len = 0  # output ids already sent to the tokenizer manager
        self.sent_text = ""  # the text last sent to it (BatchStrOut sends what follows)
        # time.perf_counter() when the first output token was committed (TTFT; sent along)
        self.first_token_time: float | None = None

        # Logprobs (accumulated, upstream format: (logprob, token_id))
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.sent_logprob_len = 0

    # ------------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def fill_ids_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building the whole list (hot path: every step)."""
        o = len(self.origin_input_ids)
        if end <= o:
            return self.origin_input_ids[start:end]
        if start >= o:
            return self.output_ids[start - o : end - o]
        return self.origin_input_ids[start:] + self.output_ids[: end - o]

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def wants_input_logprobs(self) -> bool:
        # Prompt logprobs are computed by the prefill that samples the first output token: not
        # again after a retraction of a running request (the re-prefill covers the outputs
        # too), but again from the start after one of a half-prefilled prompt (no output yet;
        # reset_for_retract dropped the partial lists).
        return (
            self.return_logprob
            and not self.output_ids
            and 0 <= self.logprob_start_len < len(self.origin_input_ids)
        )

    def draft_valid_len(self) -> int:
        """Leading tokens of fill_ids whose draft-model KV is valid too (kv_len without
        speculation): what the prefix cache may mark as usable for drafting."""
        if self.draft is None:
            return self.kv_len
        return min(self.kv_len, self.draft.draft_kv_len)

    def reset_for_retract(self) -> None:
        """Forget KV state; the request re-prefills origin_input_ids + output_ids later."""
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.num_retractions += 1
        if not self.output_ids:  # a half-prefilled prompt: its prompt logprobs start over
            self.input_token_logprobs = []
            self.input_top_logprobs = []
        if self.draft is not None:
            self.draft = type(self.draft)()


@dataclass
class ModelWorkerBatch:
    """The scheduler's plan for one forward: per request, how many tokens it computes and where
    their KV goes. All tensors are CPU; the worker moves them to its device.

    Request i computes extend_seq_lens[i] tokens at positions
    [extend_prefix_lens[i], extend_prefix_lens[i] + extend_seq_lens[i]); their ids are the i-th
    slice of input_ids and their KV slots the i-th slice of out_cache_loc.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64, set by scheduler
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots allocated by scheduler
    req_pool_indices: list[int]  # [bs]
    seq_lens: list[int]  # [bs] KV length after this step
    extend_prefix_lens: list[int]  # [bs]
    extend_seq_lens: list[int]  # [bs]
    # Logits rows: request i gets the logits of its last num_logit_rows[i] computed tokens. The
    # last row is sampled iff sample[i]; the other rows score input_logprob_targets[i].
    num_logit_rows: list[int]  # [bs]
    sample: list[bool]  # [bs]
    input_logprob_targets: list[list[int]]  # [bs][num_logit_rows[i] - sample[i]]
    sampling_info: Any  # SamplingBatchInfo over the sampled requests (rows where sample[i])
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)  # [bs]
    spec: Any = None  # SpecPlan when speculative decoding is on
    # Overlap scheduling: input_ids holds future placeholders (future_placeholder(slot), the
    # tokens of the step in flight); all_future_ids: exactly one token per request, each the
    # placeholder of its own request slot (a decode step right behind another), which the
    # worker client resolves with one gather by slot instead of a scan of the ids.
    has_future_ids: bool = False
    all_future_ids: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


@dataclass
class GenerationBatchResult:
    """What the worker returns for one ModelWorkerBatch (per request, CPU Python lists)."""

    next_token_ids: list[int | None]  # [bs]; None where the request did not sample
    next_token_logprobs: list[float | None] | None = None  # [bs]
    next_top_logprobs: list[list[tuple[float, int]] | None] | None = None  # [bs]
    input_token_logprobs: list[list[float]] | None = None  # [bs][num input rows]
    input_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    forward_time_s: float = 0.0
    # Whether forward_time_s measures the step: its device time between two events, or a
    # synchronous step's wall time. False for a pipelined step nobody asked to time
    # (SpecPlan.time_forward; pending_result.begin_step): forward_time_s is then the wall time
    # from its launch to its finish, steps queued before it included.
    forward_timed: bool = True
    # Speculative steps: per-request accepted runs (replaces next_token_ids) ...
    spec: Any = None  # SpecStepOutput | None
    # ... and, for speculative prefill steps, [bs] whether the chunk's draft extend was
    # deferred (the plan's SpecPlan.draft_keep_rows; its hidden states stay in the pool)
    draft_keep_rows: list[bool] | None = None


@dataclass
class ScheduleBatch:
    """The requests of one step and the mode they run in (scheduler-side view)."""

    reqs: list[Req]
    forward_mode: ForwardMode
    # [bs] whether the request's final prompt chunk is computed this step (it samples)
    is_final_chunk: list[bool] = field(default_factory=list)
    # [bs] tokens each request computes this step (snapshot of extend_input_len at launch: with
    # overlap scheduling the next step's plan overwrites Req.extend_input_len before commit)
    extend_lens: list[int] = field(default_factory=list)
    # [sum(extend_lens)] int64 CPU: the KV slots allocated for this step, request runs in order
    # (set by the planner; None: read them back from req_to_token)
    out_cache_loc: torch.Tensor | None = None
    # the scheduler's forward-step counter when this step was launched (consecutive decode
    # steps have consecutive indices; set by Scheduler at launch)
    step_index: int = -1

    def is_empty(self) -> bool:
        return len(self.reqs) == 0
