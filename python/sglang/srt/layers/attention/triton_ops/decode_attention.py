"""Decode attention (one query per request) over the paged KV pool (page size 1), in Triton.

Request i's single query (token i) attends to all key slots
req_to_token[req_pool_indices[i], :seq_lens[i]] (its own K/V already written there).

Two schedules, same result up to float32 rounding:
- num_splits == 1: one program per (request, query head) walks the whole KV range with an online
  softmax over BLOCK_N keys at a time (float32 accumulation) and writes the output.
- num_splits > 1 (split-K, "flash-decoding"): stage 1 runs one program per (request, head,
  split); split s covers keys [s * chunk, min((s + 1) * chunk, seq_len)) with chunk =
  cdiv(cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N computed in the kernel from the request's
  own length (so trailing splits of short requests are empty and write m = -inf, l = 0) and
  stores its partial (running max m, sum l, unnormalised acc[D]) in float32. Stage 2 runs one
  program per (request, head) and merges the splits with log-sum-exp rescaling:
  out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
  More programs for the same KV: fills the GPU when bs * heads is small and contexts are long.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.triton_ops import token_head_strides
from sglang.srt.layers.attention.triton_ops.decode_grouped import BLOCK_N as GROUPED_BLOCK_N
from sglang.srt.layers.attention.triton_ops.decode_grouped import (
    DecodeRope,
    ExtendRows,
    grouped_decode_stage1,
)
from sglang.srt.layers.triton_kernels.pdl import launch_args, pdl_wait


@triton.jit
def _attend_range(
    q,  # [D] float32
    K_buf,
    V_buf,
    r2t_row,  # pointer to req_to_token[row, 0]
    kvh,
    sm_scale,
    start,
    end,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax of q against key positions [start, end); returns (m, l, acc[D]) in
    float32 (m = -inf, l = 0, acc = 0 when the range is empty)."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        slots = tl.load(r2t_row + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(
            K_buf + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, D]
        s = tl.sum(q[None, :] * k, 1) * sm_scale  # [BLOCK_N]
        s = tl.where(n_valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: the tile holds >= 1 valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)  # [BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(
            V_buf + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, D]
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(
    do_not_specialize_on_alignment=["req_pool_indices", "seq_lens"]
)  # as extend_attention.py
def _decode_attn_kernel(
    Q,  # [bs, H, D]
    K_buf,  # [pool_slots, Hkv, D]
    V_buf,  # [pool_slots, Hkv, D]
    Out,  # [bs, H, D]
    req_to_token,  # [pool_rows, max_context_len] int32
    req_pool_indices,  # [bs]
    seq_lens,  # [bs]
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qt + h * stride_qh + offs_d).to(tl.float32)  # [D]
    m_i, l_i, acc = _attend_range(
        q,
        K_buf,
        V_buf,
        req_to_token + row * stride_r2t,
        h // GROUP,
        sm_scale,
        0,
        seq,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        HEAD_DIM,
        BLOCK_N,
    )
    out = acc / l_i
    tl.store(Out + b * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


@triton.jit(
    do_not_specialize_on_alignment=["req_pool_indices", "seq_lens"]
)  # as extend_attention.py
def _decode_attn_split_kernel(
    Q,  # [bs, H, D]
    K_buf,  # [pool_slots, Hkv, D]
    V_buf,  # [pool_slots, Hkv, D]
    Mid_o,  # [bs, H, NUM_SPLITS, D] float32, contiguous
    Mid_ml,  # [bs, H, NUM_SPLITS, 2] float32 (m, l), contiguous
    req_to_token,  # [pool_rows, max_context_len] int32
    req_pool_indices,  # [bs]
    seq_lens,  # [bs]
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    num_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = split * chunk
    end = tl.minimum(start + chunk, seq)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qt + h * stride_qh + offs_d).to(tl.float32)  # [D]
    m_i, l_i, acc = _attend_range(
        q,
        K_buf,
        V_buf,
        req_to_token + row * stride_r2t,
        h // GROUP,
        sm_scale,
        start,
        end,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        HEAD_DIM,
        BLOCK_N,
    )
    part = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + split
    tl.store(Mid_o + part * HEAD_DIM + offs_d, acc)
    tl.store(Mid_ml + part * 2, m_i)
    tl.store(Mid_ml + part * 2 + 1, l_i)


@triton.jit
def _decode_attn_reduce_kernel(
    Mid_o,  # [bs, H, NUM_SPLITS, D] float32, contiguous
    Mid_ml,  # [bs, H, NUM_SPLITS, 2] float32, contiguous
    Out,  # [bs, H, D]
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # next power of two >= NUM_SPLITS
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before the first load
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_valid = offs_s < NUM_SPLITS
    part = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s  # [SPLITS_P2]
    m = tl.load(Mid_ml + part * 2, mask=s_valid, other=float("-inf"))
    l_s = tl.load(Mid_ml + part * 2 + 1, mask=s_valid, other=0.0)
    acc = tl.load(
        Mid_o + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_valid[:, None], other=0.0
    )  # [SPLITS_P2, D]
    m_max = tl.max(m, 0)  # finite: split 0 holds >= 1 key (seq_len >= 1)
    w = tl.exp(m - m_max)  # empty splits: exp(-inf) = 0
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l_s, 0)
    tl.store(Out + b * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def alloc_decode_partials(
    bs: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for split-K decode: (mid_o [bs, H, S, D] float32, mid_ml [bs, H, S, 2] float32
    holding (max, sum) per split). Contents need no initialisation."""
    mid_o = torch.empty(bs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_ml = torch.empty(bs, num_heads, num_splits, 2, dtype=torch.float32, device=device)
    return mid_o, mid_ml


def decode_attention_fwd(
    q: torch.Tensor,  # [bs, H, D], one query per request
    k_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    v_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    out: torch.Tensor,  # [bs, H, D], written
    req_to_token: torch.Tensor,  # [pool_rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int
    seq_lens: torch.Tensor,  # [bs] int, KV length including the current token (>= 1)
    sm_scale: float,
    block_n: int | None = None,
    num_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    grouped: bool = False,
    rope: DecodeRope | None = None,
    rows: ExtendRows | None = None,
) -> None:
    """GQA decode attention; writes `out` (q's dtype) in place. H must be a multiple of Hkv.

    num_splits > 1 uses the two-stage split-K schedule (see the module docstring); `partials`
    is its scratch from alloc_decode_partials(bs, H, D, num_splits) (allocated here when None;
    pass persistent buffers under CUDA graphs to keep them out of the step). num_splits must be
    a host int fixed per shape (it sets the grid), never derived from the step's seq_lens.
    grouped: one program per (request, KV head, split) for the whole query group, with
    tensor-core dots (decode_grouped.py; block_n default 32), instead of one per query head
    (block_n default 64). rope (grouped only): q is unrotated and the grouped kernel also does
    the layer's RoPE and KV store (decode_grouped.DecodeRope). rows (grouped only,
    decode_grouped.ExtendRows): q's bs rows are the tokens of a short ragged extend, each
    attended as a decode of its own position, and req_pool_indices / seq_lens are per request.
    Raises ValueError on num_splits < 1, partials of the wrong shape, rope or rows without
    grouped, rope with rows, or rope tensors that do not fit q and the caches.
    """
    bs, h, d = q.shape
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if rope is not None and not grouped:
        raise ValueError("rope (RoPE and the KV store in the decode kernel) needs grouped=True")
    if rows is not None and not grouped:
        raise ValueError("rows (a ragged extend's tokens as decode rows) needs grouped=True")
    if bs == 0:
        return
    hkv = k_buf.shape[1]
    if block_n is None:
        block_n = GROUPED_BLOCK_N if grouped else 64
    if grouped and num_splits == 1:
        args = (q, k_buf, v_buf, out, None, req_to_token, req_pool_indices, seq_lens)
        grouped_decode_stage1(*args, sm_scale, 1, block_n, rope, rows)
        return
    if num_splits == 1:
        _decode_attn_kernel[(bs, h)](
            q,
            k_buf,
            v_buf,
            out,
            req_to_token,
            req_pool_indices,
            seq_lens,
            sm_scale,
            *token_head_strides(q, k_buf, v_buf, out),
            req_to_token.stride(0),
            GROUP=h // hkv,
            HEAD_DIM=d,
            BLOCK_N=block_n,
        )
        return
    if partials is None:
        partials = alloc_decode_partials(bs, h, d, num_splits, q.device)
    mid_o, mid_ml = partials
    if (
        mid_o.shape != (bs, h, num_splits, d)
        or mid_ml.shape != (bs, h, num_splits, 2)
        or mid_o.dtype != torch.float32
        or mid_ml.dtype != torch.float32
        or not (mid_o.is_contiguous() and mid_ml.is_contiguous())
    ):
        raise ValueError(
            f"partials must be contiguous float32 of shapes {(bs, h, num_splits, d)} and "
            f"{(bs, h, num_splits, 2)}, got {tuple(mid_o.shape)} and {tuple(mid_ml.shape)}"
        )
    if grouped:
        args = (q, k_buf, v_buf, out, partials, req_to_token, req_pool_indices, seq_lens)
        grouped_decode_stage1(*args, sm_scale, num_splits, block_n, rope, rows)
    else:
        _decode_attn_split_kernel[(bs, h, num_splits)](
            q,
            k_buf,
            v_buf,
            mid_o,
            mid_ml,
            req_to_token,
            req_pool_indices,
            seq_lens,
            sm_scale,
            *token_head_strides(q, k_buf, v_buf),
            req_to_token.stride(0),
            h,
            GROUP=h // hkv,
            HEAD_DIM=d,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
        )
    _decode_attn_reduce_kernel[(bs, h)](
        mid_o,
        mid_ml,
        out,
        out.stride(0),
        out.stride(1),
        h,
        HEAD_DIM=d,
        NUM_SPLITS=num_splits,
        SPLITS_P2=triton.next_power_of_2(num_splits),
        **launch_args(out),
    )
