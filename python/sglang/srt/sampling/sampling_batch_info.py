"""Batched sampling state for one forward step: per-row sampling tensors and penalty data.

Built fresh each step from the requests (`from_reqs`), on the model's device. One row per request
in normal decode; `expand` builds several rows per request for speculative verification, where
row j of request i scores position len(output_ids) + j with draft tokens drafts[:j] counted as
already generated (penalties, min_new_tokens and the random stream all follow that position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.random import to_int64_seed
from sglang.srt.sampling.sampling_params import SAMPLING_EPS, SamplingParams
from sglang.srt.utils.h2d import to_device_async


class SamplingReq(Protocol):
    """What from_reqs reads from a request (the scheduler's Req satisfies it)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    seed: int


@dataclass
class SamplingRow:
    """Host-side description of one row (kept so that `expand` can rebuild rows).

    output_ids may be the request's own list (not a copy): rows are read while the step is
    built and by `expand` within the same step, before the request commits more tokens.
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # generated ids counted for penalties (incl. drafts for spec rows)
    seed: int
    # tokens generated but not known yet (overlap scheduling's in-flight token): counted in the
    # output length (random position, min_new_tokens), never read (penalties drain first)
    unknown: int = 0

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + self.unknown


@dataclass
class SamplingBatchInfo:
    """Per-row sampling tensors (all on `device`). bs = number of rows."""

    temperatures: torch.Tensor  # [bs, 1] float32 (1.0 for greedy rows)
    top_ps: torch.Tensor  # [bs] float32 in (0, 1]
    top_ks: torch.Tensor  # [bs] int64 in [1, V]
    min_ps: torch.Tensor  # [bs] float32 in [0, 1]
    seeds: torch.Tensor  # [bs] int64
    random_positions: torch.Tensor  # [bs] int64, output index of the token being sampled
    greedy_mask: torch.Tensor  # [bs] bool, rows that take the exact argmax
    is_all_greedy: bool
    has_greedy: bool  # some row is greedy (greedy_mask.any(), known on the host)
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    vocab_size: int
    device: torch.device
    # Penalty data; None when no row of the batch needs it.
    repetition_penalties: torch.Tensor | None = None  # [bs] float32
    seen_mask: torch.Tensor | None = None  # [bs, V] bool, prompt + output ids
    frequency_penalties: torch.Tensor | None = None  # [bs] float32
    presence_penalties: torch.Tensor | None = None  # [bs] float32
    output_counts: torch.Tensor | None = None  # [bs, V] float32
    logit_bias: torch.Tensor | None = None  # [bs, V] float32
    min_tokens_active: torch.Tensor | None = None  # [bs] bool, output shorter than min_new_tokens
    stop_mask: torch.Tensor | None = None  # [bs, V] bool, eos + stop_token_ids
    rows: list[SamplingRow] = field(default_factory=list, repr=False)
    eos_token_ids: frozenset[int] = frozenset()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_reqs(
        cls,
        reqs: list[Any],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: set[int] | frozenset[int] | None = None,
    ) -> SamplingBatchInfo:
        """One row per request (see SamplingReq for the attributes read).

        `eos_token_ids` are masked (with each request's stop_token_ids) while the request has
        generated fewer than min_new_tokens. SamplingParams may be normalized or not.
        """
        rows = [
            SamplingRow(r.sampling_params, r.origin_input_ids, list(r.output_ids), r.seed)
            for r in reqs
        ]
        return cls.from_rows(rows, vocab_size, device, eos_token_ids)

    @classmethod
    def from_rows(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: set[int] | frozenset[int] | None = None,
    ) -> SamplingBatchInfo:
        """Build all tensors from host-side row descriptions (vectorised, one scatter each)."""
        device = torch.device(device)
        eos = frozenset(eos_token_ids or ())
        params = [r.params for r in rows]
        greedy = [_is_greedy(p) for p in params]
        top_ks = [_effective_top_k(p, vocab_size) for p in params]

        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        # One asynchronous host-to-device copy per step (pinned; ordered on the current
        # stream, so the overlap worker's stream sees it after the launch event): [3, bs]
        # int64 rows and [3, bs] float32 rows packed as bytes, viewed as the fields below.
        ints, floats = _upload_rows(
            [top_ks, [to_int64_seed(r.seed) for r in rows], [r.num_output for r in rows]],
            [temps, [p.top_p for p in params], [p.min_p for p in params]],
            device,
        )
        info = cls(
            temperatures=floats[0].view(-1, 1),
            top_ps=floats[1],
            top_ks=ints[0],
            min_ps=floats[2],
            seeds=ints[1],
            random_positions=ints[2],
            greedy_mask=ints[0] == 1,  # greedy rows (and only they) have effective top-k 1
            is_all_greedy=all(greedy),
            has_greedy=any(greedy),
            need_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy, strict=True) if not g),
            need_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy, strict=True) if not g),
            need_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy, strict=True) if not g),
            vocab_size=vocab_size,
            device=device,
            rows=rows,
            eos_token_ids=eos,
        )
        info._init_penalties(rows, eos)
        return info

    def _init_penalties(self, rows: list[SamplingRow], eos: frozenset[int]) -> None:
        params = [r.params for r in rows]
        V, dev = self.vocab_size, self.device
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalties = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=dev
            )
            seen = [r.prompt_ids + r.output_ids for r in rows]
            self.seen_mask = penaltylib.token_mask(seen, V, dev)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            self.frequency_penalties = torch.tensor(
                [p.frequency_penalty for p in params], dtype=torch.float32, device=dev
            )
            self.presence_penalties = torch.tensor(
                [p.presence_penalty for p in params], dtype=torch.float32, device=dev
            )
            self.output_counts = penaltylib.token_counts([r.output_ids for r in rows], V, dev)
        if any(p.logit_bias for p in params):
            biases = [_int_keys(p.logit_bias) for p in params]
            self.logit_bias = penaltylib.logit_bias_tensor(biases, V, dev)
        active = [r.num_output < r.params.min_new_tokens for r in rows]
        if any(active):
            self.min_tokens_active = torch.tensor(active, dtype=torch.bool, device=dev)
            stops = [sorted(eos | set(r.params.stop_token_ids or ())) for r in rows]
            self.stop_mask = penaltylib.token_mask(stops, V, dev)

    @property
    def reads_output_ids(self) -> bool:
        """Whether some row's penalties read its generated ids (then `expand` needs the
        drafts on the host)."""
        return any(_reads_output_ids(r.params) for r in self.rows)

    @property
    def has_logits_processors(self) -> bool:
        """Whether apply_logits_processors changes anything for these rows. Rows built by
        `expand` have none when their requests have none (their outputs are only longer, so
        min_new_tokens stays inactive)."""
        fields = (self.seen_mask, self.output_counts, self.logit_bias, self.min_tokens_active)
        return any(f is not None for f in fields)

    def expand(
        self, row_counts: list[int], extra_output_ids: list[list[int]] | None
    ) -> SamplingBatchInfo:
        """Rows for speculative verification: request i gets row_counts[i] rows.

        Row j (0 <= j < row_counts[i]) of request i treats extra_output_ids[i][:j] (its draft
        tokens) as generated: penalties count them, min_new_tokens uses len(output) + j, and
        random_positions = len(output_ids) + j, so a row samples exactly what the non-speculative
        step at that position would. extra_output_ids may be None (drafts still on the device)
        when no row reads its output ids (`reads_output_ids` false). Raises ValueError when
        lengths disagree, or for None drafts with rows that read them.
        """
        if extra_output_ids is None:
            if self.reads_output_ids:
                raise ValueError("expand: penalties read the drafts, but none were given")
            extra_output_ids = [[0] * (n - 1) for n in row_counts]  # counted, never read
        if len(row_counts) != len(self.rows) or len(extra_output_ids) != len(self.rows):
            raise ValueError(
                f"expand: {len(row_counts)} row counts / {len(extra_output_ids)} draft lists "
                f"for {len(self.rows)} requests"
            )
        new_rows = []
        for row, count, drafts in zip(self.rows, row_counts, extra_output_ids, strict=True):
            if count < 1 or len(drafts) < count - 1:
                raise ValueError(f"expand: {count} rows need >= {count - 1} drafts and count >= 1")
            if not _reads_output_ids(row.params):  # only the length counts: no list copies
                for j in range(count):
                    new_rows.append(
                        SamplingRow(
                            row.params, row.prompt_ids, row.output_ids, row.seed, row.unknown + j
                        )
                    )
                continue
            for j in range(count):
                out = row.output_ids + [0] * row.unknown + list(drafts[:j])
                new_rows.append(SamplingRow(row.params, row.prompt_ids, out, row.seed))
        return SamplingBatchInfo.from_rows(
            new_rows, self.vocab_size, self.device, self.eos_token_ids
        )

    # ------------------------------------------------------------------ use
    @property
    def batch_size(self) -> int:
        return self.seeds.shape[0]

    def apply_logits_processors(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, logit_bias and min_new_tokens (order in penaltylib's docstring).

        logits [bs, V] float32 -> [bs, V] float32; the input is never modified in place (it is
        returned as is when nothing applies).
        """
        if self.seen_mask is not None:
            logits = penaltylib.apply_repetition_penalty(
                logits, self.seen_mask, self.repetition_penalties
            )
        if self.output_counts is not None:
            logits = penaltylib.apply_frequency_presence(
                logits, self.output_counts, self.frequency_penalties, self.presence_penalties
            )
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        if self.min_tokens_active is not None:
            logits = penaltylib.apply_min_new_tokens(logits, self.stop_mask, self.min_tokens_active)
        return logits


def _upload_rows(
    int_rows: list[list[int]], float_rows: list[list[float]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """([3, bs] int64, [3, bs] float32) on `device`; on CUDA from one packed host-to-device
    copy (pack_rows / unpack_rows)."""
    ints = torch.tensor(int_rows, dtype=torch.int64, device="cpu")
    floats = torch.tensor(float_rows, dtype=torch.float32, device="cpu")
    if device.type != "cuda":
        return ints.to(device), floats.to(device)
    return unpack_rows(to_device_async(pack_rows(ints, floats), device), ints.shape)


def pack_rows(ints: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
    """The bytes of ints (int64, contiguous) followed by those of floats (float32, the same
    number of elements): one uint8 tensor, so that one copy moves both."""
    return torch.cat([ints.reshape(-1).view(torch.uint8), floats.reshape(-1).view(torch.uint8)])


def unpack_rows(packed: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_rows (views of `packed`, on its device): (int64 [shape], float32
    [shape]). The int64 block comes first, so both views are aligned."""
    n = 8 * shape.numel()
    return packed[:n].view(torch.int64).view(shape), packed[n:].view(torch.float32).view(shape)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < SAMPLING_EPS or p.top_k == 1


def _effective_top_k(p: SamplingParams, vocab_size: int) -> int:
    if _is_greedy(p):
        return 1
    if p.top_k < 1 or p.top_k > vocab_size:
        return vocab_size
    return p.top_k


def _reads_output_ids(p: SamplingParams) -> bool:
    """Whether a row's penalties read its generated ids (not only their number)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _int_keys(bias: dict | None) -> dict[int, float] | None:
    if not bias:
        return None
    return {int(k): float(v) for k, v in bias.items()}
