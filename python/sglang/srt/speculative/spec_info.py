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

import numpy as np
import torch

from sglang.srt.utils.h2d import int64_to_device


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


# Pending-state chunks a request keeps before they are copied into one tensor (each chunk
# references a whole step's hidden states, [R, 3H]).
COMPACT_CHUNKS = 16


@dataclass
class EagleDraftInput:
    """Per-request draft state, stored on the scheduler's Req.

    The pending target aux hidden states of positions [draft_kv_len, draft_kv_len +
    num_pending) are kept as row ranges of the tensors that hold them (`chunks`: (tensor [R, 3
    * target_hidden] model dtype on the model device, first row, end row)): at first the step
    outputs that produced them, after a compaction one range of a concatenation that may be
    shared with other requests compacted in the same step (compact_pending). They are made
    contiguous only when the request drafts (`hidden_states`). A step that does not draft
    therefore costs one list append per request, not a device copy.

    The first `num_compacted` chunks are compaction results ("segments"); the rest reference
    step outputs. A compaction gathers only the chunks after the segments, so rows are copied
    once while a request keeps not drafting (not once per compaction), and a request that
    drafts again concatenates its segments once.
    """

    draft_kv_len: int = 0  # positions whose draft KV is valid
    chunks: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    num_pending: int = 0  # rows in chunks
    num_compacted: int = 0  # leading chunks that are compaction segments
    stale: bool = False  # pending states were dropped: this request cannot draft any more

    @property
    def hidden_states(self) -> torch.Tensor | None:
        """[num_pending, 3 * target_hidden] (one concatenation, kept, when there are several
        chunks; else a view of the one range), or None when empty."""
        if not self.chunks:
            return None
        if len(self.chunks) > 1:
            compact_pending([self], full=True)
        t, a, b = self.chunks[0]
        return t if a == 0 and b == t.shape[0] else t[a:b]

    @property
    def compaction_due(self) -> bool:
        """COMPACT_CHUNKS or more chunks after the segments: time to copy them into one range
        (the step outputs they reference are then released)."""
        return self.num_uncompacted >= COMPACT_CHUNKS

    @property
    def num_uncompacted(self) -> int:
        """Chunks that still reference step outputs."""
        return len(self.chunks) - self.num_compacted

    def append_rows(
        self, hidden: torch.Tensor, start: int, end: int, max_pending: int, compact: bool = True
    ) -> None:
        """Add rows [start, end) of hidden: the states of newly committed positions. With
        `compact`, every COMPACT_CHUNKS chunks are copied into one tensor of this request's
        rows, so a request that does not draft keeps its own rows alive, not whole step
        outputs; without, the caller compacts (compact_pending over the requests whose
        compaction_due, one copy for all of them)."""
        if self.stale or end <= start:
            return
        self.chunks.append((hidden, start, end))
        self.num_pending += end - start
        if self.num_pending > max_pending:  # bound memory for requests that stopped drafting
            self.clear()
            self.stale = True
        elif compact and self.compaction_due:
            compact_pending([self])

    def clear(self) -> None:
        """The draft consumed every pending state."""
        self.chunks = []
        self.num_pending = 0
        self.num_compacted = 0


def compact_pending(drafts: list[EagleDraftInput], full: bool = False) -> None:
    """Copy pending rows of every draft in `drafts` into one tensor and give each draft its own
    contiguous row range of it, in order: the chunks after its segments (a new segment after
    the existing ones), or with `full` all its chunks (one range; before it drafts). Drafts
    with nothing to gather are skipped.

    A plain step gives each request one row of a [bs, 3H] step output, so a compaction of
    many requests gathers many single rows from a few sources. Rather than one slice per
    chunk (host work per row), the distinct sources are concatenated (one torch.cat) and the
    rows picked with one index_select (one host-to-device index copy): three device ops
    whatever the number of rows, at the price of copying the unused rows of the sources once
    (a few MB).

    The sources may come from the overlap worker's stream and be freed right after:
    record_stream (once per distinct source) keeps their memory from being reused there before
    this copy has read it. The result lives as long as any draft still references its range
    (until each of them drafts or finishes)."""
    if full:
        for d in drafts:
            if len(d.chunks) > 1:
                _join_chunks(d)
        return
    picked = [(d, d.num_compacted) for d in drafts if d.num_uncompacted > 0]  # (draft, first)
    if not picked:
        return
    sources: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, first row in the cat)
    rows: list[int] = []
    counts: list[int] = []  # rows gathered per picked draft
    total = 0
    for d, first in picked:
        n0 = len(rows)
        for t, a, b in d.chunks[first:]:
            entry = sources.get(id(t))
            if entry is None:
                entry = sources[id(t)] = (t, total)
                total += t.shape[0]
            rows.extend(range(entry[1] + a, entry[1] + b))
        counts.append(len(rows) - n0)
    tensors = [t for t, _ in sources.values()]
    big = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
    if rows == list(range(big.shape[0])):
        cat = big if len(tensors) > 1 else big.clone()
    else:
        (idx,) = int64_to_device([rows], big.device)
        cat = big.index_select(0, idx)
    if cat.is_cuda:
        stream = torch.cuda.current_stream(cat.device)
        for t in tensors:
            t.record_stream(stream)
    off = 0
    for (d, first), n in zip(picked, counts, strict=True):
        d.chunks = d.chunks[:first] + [(cat, off, off + n)]
        d.num_compacted = len(d.chunks)
        off += n


def _join_chunks(d: EagleDraftInput) -> None:
    """All of d's chunks as one tensor of its own rows (slices, then one concatenation).
    Segments are shared with the requests compacted alongside, so concatenating whole sources
    (compact_pending's batch path) would copy theirs too."""
    joined = torch.cat([t[a:b] for t, a, b in d.chunks])
    if joined.is_cuda:
        stream = torch.cuda.current_stream(joined.device)
        for t in {id(t): t for t, _, _ in d.chunks}.values():
            t.record_stream(stream)
    d.chunks = [(joined, 0, joined.shape[0])]
    d.num_compacted = 1


@dataclass
class SpecPlan:
    """The speculative half of a ModelWorkerBatch (per request lists, set by the scheduler)."""

    draft_lens: list[int]  # [bs] d_i for this step; 0 = no drafting (plain decode row)
    # Draft catch-up for requests with d_i > 0: draft extend over positions
    # [draft_kv_len_i, kv_len_i) with tokens fill_ids[t + 1] and the pending hidden states.
    # Indexed by request; empty lists when no request drafts this step.
    catchup_ids: list[list[int]] = field(default_factory=list)  # [bs][c_i]
    catchup_prefix_lens: list[int] = field(default_factory=list)  # [bs] draft_kv_len_i
    catchup_slots: list[np.ndarray | None] = field(default_factory=list)  # [bs] [c_i] int64
    catchup_hidden: list[torch.Tensor | None] = field(default_factory=list)  # [bs] [c_i, 3H]
    # Prefill (EXTEND) steps: draft extend over the chunk's first e_i positions with tokens
    # fill_ids[t + 1] (e_i = chunk length, minus 1 for the final chunk).
    draft_extend_ids: list[list[int]] = field(default_factory=list)  # [bs][e_i]
    # Prefill steps: True where the draft extend is deferred (draft_extend_ids[i] is empty):
    # the worker returns the chunk's aux hidden states, all n_i rows, for the catch-up of the
    # request's first drafting step (SpecScheduler.defers_draft_extend).
    draft_keep_rows: list[bool] = field(default_factory=list)  # [bs]


@dataclass
class SpecStepOutput:
    """Per-request results of a speculative step (CPU lists, plus device hidden states)."""

    tokens: list[list[int]]  # [bs][a_i + 1] accepted drafts then the bonus token
    num_accepted: list[int]  # [bs] a_i
    logprobs: list[list[float]] | None  # [bs][a_i + 1] target logprobs of `tokens`
    top_logprobs: list[list[list[tuple[float, int]]]] | None
    # [R, 3H] target aux hidden states; request i's committed positions [n_i, n_i + a_i + 1)
    # are rows hidden_starts[i] .. hidden_starts[i] + a_i (rows beyond a stop inside the run
    # are dropped by the scheduler): the next EagleDraftInput
    hidden_states: torch.Tensor
    hidden_starts: list[int]  # [bs]
