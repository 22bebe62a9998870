"""Data passed between the scheduler and the speculative worker.

The scheduler owns every field: it decides each request's draft length for the step, allocates
the KV slots (whose rows in the hidden state pool hold the target hidden states the draft
model still has to consume) and tracks how far each request's draft KV reaches
(EagleDraftInput). The worker reads a SpecPlan and returns SpecStepOutput; it keeps nothing
between steps.

Draft alignment (EAGLE, arXiv 2401.15077, section 3): draft position t consumes the target's
hidden state at position t and the token at position t + 1, and predicts the token at t + 2.
So a request whose committed tokens are x_0..x_n (target KV for positions < n) has draft KV for
positions < draft_kv_len, and the target hidden states of positions [draft_kv_len, n) catch
the draft up before it drafts again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np


class SpeculativeAlgorithm(Enum):
    NONE = "NONE"
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"

    @staticmethod
    def from_string(name: str | None) -> SpeculativeAlgorithm:
        if name is None:
            return SpeculativeAlgorithm.NONE
        try:
            return SpeculativeAlgorithm[name.upper()]
        except KeyError:
            raise ValueError(
                f"--speculative-algorithm {name!r} is not supported; choose EAGLE3 or EAGLE"
            ) from None

    def is_none(self) -> bool:
        return self == SpeculativeAlgorithm.NONE


@dataclass
class EagleDraftInput:
    """Per-request draft state, stored on the scheduler's Req.

    The draft KV is valid for positions [0, draft_kv_len). The target hidden states of the
    positions the draft has not consumed yet, [draft_kv_len, kv_len), are the rows of their
    KV slots in the hidden state pool (mem_cache/hidden_state_pool.py): the catch-up of the
    request's next drafting step reads them there, so a step that does not draft keeps
    nothing per request.
    """

    draft_kv_len: int = 0  # positions whose draft KV is valid
    stale: bool = False  # the draft can no longer catch up: this request never drafts again


def pending_positions(req: Any) -> int:
    """Positions the catch-up of req's next drafting step would cover, whose target hidden
    states are the pool rows of their KV slots: kv_len - draft.draft_kv_len; 0 for a request
    that can never draft again (draft.stale: it never runs that catch-up, and counting its
    lag would make drafting look costly for everyone it is batched with). `req` is a Req or
    anything with `kv_len` and `draft` (the adaptive controller's duck-typed requests)."""
    return 0 if req.draft.stale else req.kv_len - req.draft.draft_kv_len


@dataclass
class SpecPlan:
    """The speculative half of a ModelWorkerBatch (per request lists, set by the scheduler)."""

    draft_lens: list[int]  # [bs] d_i for this step; 0 = no drafting (plain decode row)
    # Draft catch-up for requests with d_i > 0: draft extend over positions
    # [draft_kv_len_i, kv_len_i) with tokens fill_ids[t + 1] and the pending hidden states.
    # Indexed by request; empty lists when no request drafts this step.
    catchup_ids: list[list[int]] = field(default_factory=list)  # [bs][c_i]
    catchup_prefix_lens: list[int] = field(default_factory=list)  # [bs] draft_kv_len_i
    # [bs] [c_i] int64 KV slots of those positions: the draft KV goes there, and the hidden
    # states are read from the hidden state pool's rows of the same slots
    catchup_slots: list[np.ndarray | None] = field(default_factory=list)
    # Prefill (EXTEND) steps: draft extend over the chunk's first e_i positions with tokens
    # fill_ids[t + 1] (e_i = chunk length, minus 1 for the final chunk).
    draft_extend_ids: list[list[int]] = field(default_factory=list)  # [bs][e_i]
    # Prefill steps: True where the draft extend is deferred (draft_extend_ids[i] is empty):
    # the chunk's hidden states stay in the pool for the catch-up of the request's first
    # drafting step (SpecScheduler.defers_draft_extend).
    draft_keep_rows: list[bool] = field(default_factory=list)  # [bs]
    # Decode steps: whether the worker times the step on the device (two CUDA timing events
    # and a read of the elapsed time, ~10 us of host work) when it pipelines it. The adaptive
    # controller asks for it on every step except most plain steps that follow a plain one
    # (StepTiming.wants_forward_time); drafting steps run synchronously and are timed
    # either way. Nobody reads it without --speculative-adaptive.
    time_forward: bool = True


@dataclass
class SpecStepOutput:
    """Per-request results of a speculative step (CPU lists; the target hidden states of the
    step's tokens went to the hidden state pool)."""

    tokens: list[list[int]]  # [bs][a_i + 1] accepted drafts then the bonus token
    num_accepted: list[int]  # [bs] a_i
    logprobs: list[list[float]] | None  # [bs][a_i + 1] target logprobs of `tokens`
    top_logprobs: list[list[list[tuple[float, int]]]] | None
