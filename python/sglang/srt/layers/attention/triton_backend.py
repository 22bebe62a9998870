"""Triton attention backend: our own kernels for decode and ragged causal extend.

Reads K/V through the paged req_to_token table (page size 1). Same semantics as
torch_native_backend.attention_reference: request i's queries sit at positions
[extend_prefix_lens[i], seq_lens[i]) and each attends causally to its request's keys.
On CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1, slow; tests).

Decode schedule (TritonAttnBackend.grouped_decode): by default one program per (request, KV
head, split) for the whole GQA group (triton_ops/decode_grouped.py), with
grouped_decode_num_splits(bs, Hkv, SMs) splits (up to 32; a split holds at least 32 keys of
the request's own length, so short contexts leave splits empty). SGLANG_TRITON_DECODE_GROUPED=0
selects the per-head kernels: one program per (request, query head), split-K
(decode_num_splits) with DECODE_SPLITS (8) splits when the KV pool's req_to_token rows hold at
least SPLIT_MIN_CONTEXT (2048) tokens and bs * H < 2 * (number of SMs), else 1. All inputs of
either rule are static per CUDA graph (bs is the graph's batch bucket, the row width is the
model's context length + 8), never the step's actual lengths. Off on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention import check_backend_device
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.triton_ops.decode_attention import (
    alloc_decode_partials,
    decode_attention_fwd,
)
from sglang.srt.layers.attention.triton_ops.decode_grouped import (
    DecodeRope,
    ExtendRows,
    grouped_decode_num_splits,
)
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import env_flag

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class TritonMetadata:
    """Per-forward index tensors shared by every layer (all on the model's device)."""

    # The ForwardBatch's own int64 tensors (the kernels cast on load); under CUDA graphs the
    # runner's persistent buffers.
    req_pool_indices: torch.Tensor  # [bs] int64, row of req_to_token per request
    seq_lens: torch.Tensor  # [bs], KV length after this step
    prefix_lens: torch.Tensor  # [bs], KV already cached before this step
    extend_lens: torch.Tensor  # [bs], queries per request this step
    extend_start: torch.Tensor  # [bs], offset of request i's first query token
    max_extend_len: int
    is_decode: bool  # every request has exactly one query
    # a short target verify whose token rows attend as decodes (SGLANG_TRITON_VERIFY_DECODE,
    # TritonAttnBackend.verify_as_decode): static per CUDA graph
    extend_as_decode: bool = False
    # split-K decode scratch, allocated by the first decode layer of the forward and shared by
    # all layers (they run one after another); keyed (H, D, num_splits). Under CUDA graphs it
    # is allocated in the warm-up runs and persists with this metadata, so replays reuse it.
    decode_partials: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernels take head_dim: a power of two in [16, 256] (their tile sizes)."""
    return 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless head_dim_supported(head_dim)."""
    if not head_dim_supported(head_dim):
        raise ValueError(
            f"--attention-backend triton needs head_dim to be a power of two in [16, 256] "
            f"(e.g. 64 or 128), got {head_dim}; use --attention-backend torch_native"
        )


# Verify as decodes (on unless SGLANG_TRITON_VERIFY_DECODE=0): a target verify step of at most
# VERIFY_DECODE_MAX_BS requests and VERIFY_DECODE_MAX_EXTEND tokens each runs the grouped decode
# kernel over its token rows (ExtendRows) instead of the extend kernel. On the H200 (thirty-
# fourth session, SmolLM2 batch-1 static K = 3, float32) it took the verify graph from 3.37 to
# 1.47 ms and the step from 3.54 to 2.47 ms, with the same accepted drafts (verify_decode
# {0,1}_fp32_bs1_h200_s34.json) and no mismatch against no speculation
# (eagle3_accept_length_vd1_float32_h200_s34.json).
VERIFY_DECODE_MAX_BS = 32
VERIFY_DECODE_MAX_EXTEND = 8
DECODE_SPLITS = 8  # KV splits per (request, head) when split-K decode is on
SPLIT_MIN_CONTEXT = 2048  # split only when requests can be this long (req_to_token width)


class TritonAttnBackend(AttentionBackend):
    """Attention through triton_ops kernels; one kernel launch per layer (two for split-K
    decode), no per-request loops.

    decode_num_splits: force the decode split count (tests); None applies the module's rule.
    grouped_decode: the GQA-grouped decode kernel (default: on unless
    SGLANG_TRITON_DECODE_GROUPED=0) or the per-head one.
    verify_as_decode: short target verify steps attend as grouped decodes over their token
    rows (default: on unless SGLANG_TRITON_VERIFY_DECODE=0; needs grouped_decode; see
    VERIFY_DECODE_MAX_BS / VERIFY_DECODE_MAX_EXTEND).
    Raises ValueError on a CPU model runner unless TRITON_INTERPRET=1 is set.
    """

    saves_kv_through_pool = True  # forward: pool.set_kv_buffer, then reads the pool

    @property
    def fuses_decode_rope(self) -> bool:
        """Whether decode steps may hand this backend the layer's RoPE and KV store
        (forward's rope; the grouped decode kernel does them)."""
        return self.grouped_decode

    def __init__(
        self,
        model_runner=None,
        decode_num_splits: int | None = None,
        grouped_decode: bool | None = None,
        verify_as_decode: bool | None = None,
    ) -> None:
        self.model_runner = model_runner
        self.forced_decode_splits = decode_num_splits
        if grouped_decode is None:
            grouped_decode = env_flag("TRITON_DECODE_GROUPED", "1") != "0"
        self.grouped_decode = grouped_decode
        if verify_as_decode is None:
            verify_as_decode = env_flag("TRITON_VERIFY_DECODE", "1") != "0"
        self.verify_as_decode = verify_as_decode and grouped_decode
        device = getattr(model_runner, "device", None)
        check_backend_device("triton", device)
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms: int | None = None  # None: not on CUDA, split-K off
        if device is not None and torch.device(device).type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def decode_num_splits(
        self, bs: int, num_heads: int, max_context_len: int, num_kv_heads: int | None = None
    ) -> int:
        """KV splits for a decode step of bs requests and num_heads query heads over a
        req_to_token of max_context_len columns: the forced value if given; with the grouped
        kernel grouped_decode_num_splits(bs, num_kv_heads, SMs) (num_kv_heads required:
        ValueError without it); else DECODE_SPLITS when max_context_len >= SPLIT_MIN_CONTEXT
        and bs * num_heads < 2 * SMs, else 1. Depends only on static shapes, so it is fixed
        per CUDA graph."""
        if self.forced_decode_splits is not None:
            return self.forced_decode_splits
        if self.grouped_decode:
            if num_kv_heads is None:
                raise ValueError("the grouped decode split rule needs num_kv_heads")
            return grouped_decode_num_splits(bs, num_kv_heads, self.num_sms)
        if self.num_sms is None or max_context_len < SPLIT_MIN_CONTEXT:
            return 1
        return DECODE_SPLITS if bs * num_heads < 2 * self.num_sms else 1

    def _metadata(self, fb: ForwardBatch, max_extend_len: int, is_decode: bool) -> TritonMetadata:
        """Metadata over fb's own index tensors (the kernels cast them on load)."""
        as_decode = (
            self.verify_as_decode
            and not is_decode
            and fb.forward_mode == ForwardMode.TARGET_VERIFY
            and fb.batch_size <= VERIFY_DECODE_MAX_BS
            and max_extend_len <= VERIFY_DECODE_MAX_EXTEND
        )
        return TritonMetadata(
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            prefix_lens=fb.extend_prefix_lens,
            extend_lens=fb.extend_seq_lens,
            extend_start=fb.extend_start_loc,
            max_extend_len=max_extend_len,
            is_decode=is_decode,
            extend_as_decode=as_decode,
        )

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        ext_cpu = forward_batch.extend_seq_lens_cpu
        max_ext = max(ext_cpu) if ext_cpu else 0
        # one query per request and no other token rows: a padded static batch (e.g. the
        # chain drafting graph's catch-up, b * (K + 1) rows) may hold unassigned rows, which
        # the decode kernel, one program per row, would index requests with
        is_decode = (
            bool(ext_cpu)
            and max_ext == 1
            and min(ext_cpu) == 1
            and forward_batch.num_tokens == forward_batch.batch_size
        )
        forward_batch.attn_metadata = self._metadata(forward_batch, max_ext, is_decode)

    # ---- CUDA graphs: the metadata points at the runner's persistent buffers, which it
    # refreshes before each replay; nothing to recompute here.
    supports_cuda_graph = True

    def init_forward_metadata_capture_cuda_graph(
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        fb = forward_batch
        fb.attn_metadata = self._metadata(fb, max_extend_len, fb.num_tokens == fb.batch_size)

    def init_forward_metadata_replay_cuda_graph(
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        pass

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H * D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        rope: DecodeRope | None = None,
    ) -> torch.Tensor:  # [num_tokens, H * D] in q's dtype
        """rope (fused_rope_kv.decode_rope, a decode step with the grouped kernel only): q and
        k are unrotated, and the decode kernel does the RoPE and the KV store; raises
        ValueError on another step or with save_kv_cache."""
        h, d = layer.tp_q_head_num, layer.head_dim
        check_head_dim(d)
        if h % layer.tp_k_head_num:
            raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads")
        m: TritonMetadata = forward_batch.attn_metadata
        if rope is not None and (save_kv_cache or not m.is_decode or not self.grouped_decode):
            raise ValueError(
                "rope (RoPE and the KV store in the decode kernel) needs a decode step with the "
                "grouped decode kernel and save_kv_cache=False"
            )
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, h, d)
        # the decode kernels write every row (a CUDA-graph pad request attends to slot 0, a
        # padding token row of extend_as_decode to its last request); extend: zeros, so rows
        # no request owns (CUDA-graph token padding) stay finite
        as_decode = m.is_decode or m.extend_as_decode
        out = torch.empty_like(q) if as_decode else torch.zeros_like(q)
        r2t = forward_batch.req_to_token_pool.req_to_token
        if as_decode:
            bs = q.shape[0]  # rows: requests, or the extend's tokens (ExtendRows)
            splits = self.decode_num_splits(bs, h, r2t.shape[1], layer.tp_k_head_num)
            partials = None
            if splits > 1:
                partials = m.decode_partials.get((h, d, splits))
                if partials is None:
                    partials = alloc_decode_partials(bs, h, d, splits, q.device)
                    m.decode_partials[(h, d, splits)] = partials
            decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                r2t,
                m.req_pool_indices,
                m.seq_lens,
                layer.scaling,
                num_splits=splits,
                partials=partials,
                grouped=self.grouped_decode,
                rope=rope,
                rows=ExtendRows(m.extend_start, m.prefix_lens) if m.extend_as_decode else None,
            )
        else:
            extend_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                r2t,
                m.req_pool_indices,
                m.seq_lens,
                m.prefix_lens,
                m.extend_lens,
                m.extend_start,
                m.max_extend_len,
                layer.scaling,
            )
        return out.view(-1, h * d)
