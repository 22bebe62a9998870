"""Data passed between the scheduler and the speculative worker.

The scheduler owns every field: it decides each request's draft length for the step, allocates
the KV slots, and keeps the target hidden states the draft model still has to consume
(EagleDraftInput). The worker reads a SpecPlan and returns SpecStepOutput; it keeps nothing
between steps.

Draft alignment (EAGLE, arXiv 2401.15077, section 3): draft position t consumes the target's
hidden state at position t and the token at position t + 1, and predicts the token at t + 2.
So a request whose committed tokens are x_0..x_n (target KV for positions < n) has draft KV for
positions < draft_kv_len, and keeps the target hidden states of positions
[draft_kv_len, n) to catch the draft up before it drafts again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


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

    hidden_states: [num_pending, 3 * target_hidden] target aux hidden states of positions
    [draft_kv_len, draft_kv_len + num_pending), model dtype, on the model device; None when
    nothing is pending.
    """

    draft_kv_len: int = 0  # positions whose draft KV is valid
    hidden_states: torch.Tensor | None = None
    stale: bool = False  # pending states were dropped: this request cannot draft any more

    @property
    def num_pending(self) -> int:
        return 0 if self.hidden_states is None else int(self.hidden_states.shape[0])

    def append(self, hidden: torch.Tensor, max_pending: int) -> None:
        """Add the target hidden states of newly committed positions."""
        if self.stale:
            return
        self.hidden_states = (
            hidden if self.hidden_states is None else torch.cat([self.hidden_states, hidden])
        )
        if self.num_pending > max_pending:  # bound memory for requests that stopped drafting
            self.hidden_states = None
            self.stale = True


@dataclass
class SpecPlan:
    """The speculative half of a ModelWorkerBatch (per request lists, set by the scheduler)."""

    draft_lens: list[int]  # [bs] d_i for this step; 0 = no drafting (plain decode row)
    # Draft catch-up for requests with d_i > 0: draft extend over positions
    # [draft_kv_len_i, kv_len_i) with tokens fill_ids[t + 1] and the pending hidden states.
    catchup_ids: list[list[int]] = field(default_factory=list)  # [bs][c_i]
    catchup_prefix_lens: list[int] = field(default_factory=list)  # [bs] draft_kv_len_i
    catchup_slots: list[torch.Tensor | None] = field(default_factory=list)  # [bs] [c_i] int64
    catchup_hidden: list[torch.Tensor | None] = field(default_factory=list)  # [bs] [c_i, 3H]
    # Prefill (EXTEND) steps: draft extend over the chunk's first e_i positions with tokens
    # fill_ids[t + 1] (e_i = chunk length, minus 1 for the final chunk).
    draft_extend_ids: list[list[int]] = field(default_factory=list)  # [bs][e_i]


@dataclass
class SpecStepOutput:
    """Per-request results of a speculative step (CPU lists, plus device hidden states)."""

    tokens: list[list[int]]  # [bs][a_i + 1] accepted drafts then the bonus token
    num_accepted: list[int]  # [bs] a_i
    logprobs: list[list[float]] | None  # [bs][a_i + 1] target logprobs of `tokens`
    top_logprobs: list[list[list[tuple[float, int]]]] | None
    # [bs] target aux hidden states of the committed positions [n_i, n_i + a_i + 1): the next
    # EagleDraftInput (rows beyond a stop inside the run are dropped by the scheduler)
    hidden_states: list[torch.Tensor]
