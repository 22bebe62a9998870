"""Decode attention (one query per request) over the paged KV pool (page size 1), in Triton.

Request i's single query (token extend_start[i]) attends to all key slots
req_to_token[req_pool_indices[i], :seq_lens[i]] (its own K/V already written there).
One program per (request, query head); online softmax over BLOCK_N keys at a time with
float32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
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
    kvh = h // GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qt + h * stride_qh + offs_d).to(tl.float32)  # [D]

    m_i = tl.full([1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for n0 in range(0, seq, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_valid, other=0)
        slots = slots.to(tl.int64)
        k = tl.load(
            K_buf + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, D]
        s = tl.sum(q[None, :] * k, 1) * sm_scale  # [BLOCK_N]
        s = tl.where(n_valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))  # [1]
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
    out = acc / l_i
    tl.store(Out + b * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def decode_attention_fwd(
    q: torch.Tensor,  # [bs, H, D], one query per request
    k_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    v_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    out: torch.Tensor,  # [bs, H, D], written
    req_to_token: torch.Tensor,  # [pool_rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int
    seq_lens: torch.Tensor,  # [bs] int, KV length including the current token (>= 1)
    sm_scale: float,
    block_n: int = 64,
) -> None:
    """GQA decode attention; writes `out` in place. H must be a multiple of Hkv."""
    bs, h, d = q.shape
    if bs == 0:
        return
    hkv = k_buf.shape[1]
    _decode_attn_kernel[(bs, h)](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=h // hkv,
        HEAD_DIM=d,
        BLOCK_N=block_n,
    )
