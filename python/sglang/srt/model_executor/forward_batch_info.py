"""ForwardBatch: the tensors one model forward reads, built by the ModelRunner from the
scheduler's ModelWorkerBatch.

Every step is a ragged extend: request i computes `extend_seq_lens[i]` new tokens on top of
`extend_prefix_lens[i]` tokens whose KV is already in the pool. DECODE is the special case
where every request computes exactly one token; TARGET_VERIFY (speculation) computes 1 + d_i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sglang.srt.utils.h2d import int64_to_device

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill chunks (any mix of lengths, possibly with cached prefixes)
    DECODE = auto()  # every request computes exactly one token
    TARGET_VERIFY = auto()  # speculative verify: 1 + d_i tokens per request
    DRAFT_EXTEND = auto()  # draft model over target hidden states
    IDLE = auto()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


class CaptureHiddenMode(IntEnum):
    NULL = auto()  # no hidden states returned
    LAST = auto()  # hidden state of each logits row
    FULL = auto()  # hidden states of every computed token


@dataclass
class ForwardBatch:
    """Per-step model inputs. All tensors live on the model's device unless suffixed `_cpu`."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each token's K/V is written to
    req_pool_indices: torch.Tensor  # [bs] int64, row of req_to_token for each request
    seq_lens: torch.Tensor  # [bs] int64, prefix + extend length (KV length after this step)
    extend_seq_lens: torch.Tensor  # [bs] int64, tokens computed this step per request
    extend_prefix_lens: torch.Tensor  # [bs] int64, tokens already in the KV pool
    extend_start_loc: torch.Tensor  # [bs] int64, offset of request i's first token in input_ids
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    # Rows of the token stream whose logits are computed (default: each request's last token).
    logits_indices: torch.Tensor  # [num_logit_rows] int64
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # Scratch space for attention backends (metadata computed once per forward).
    attn_metadata: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def positions_and_starts(
    prefix_lens: list[int], extend_lens: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Positions of every computed token and each request's start offset in the token stream,
    on the host (numpy: no torch call per step).

    Returns (positions [sum(extend_lens)] int64, extend_start_loc [bs] int64)."""
    pre = np.asarray(prefix_lens, dtype=np.int64)
    ext = np.asarray(extend_lens, dtype=np.int64)
    starts = np.cumsum(ext) - ext
    positions = np.arange(int(ext.sum()), dtype=np.int64) - np.repeat(starts - pre, ext)
    return positions, starts


def build_positions_and_starts(
    prefix_lens: list[int], extend_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions_and_starts as int64 tensors on `device` (one host-to-device copy)."""
    positions, starts = int64_to_device(
        list(positions_and_starts(prefix_lens, extend_lens)), device
    )
    return positions, starts
