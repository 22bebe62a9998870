"""Ragged causal extend attention over the paged KV pool (page size 1), in Triton.

Request i computes queries at positions [prefix_lens[i], seq_lens[i]); its keys/values are the
pool slots req_to_token[req_pool_indices[i], :seq_lens[i]] (the new tokens' K/V must already be
written there). Query j of request i attends to key positions [0, prefix_lens[i] + j].
One program per (request, query head, block of BLOCK_M queries); flash-attention style online
softmax with float32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.triton_ops import token_head_strides


# Per-request index vectors are read one element per program and are views at offsets that
# follow the step's shape (a packed upload: positions first, so T's parity moves the rest):
# not specialized on alignment, or a catch-up of an odd token count compiles a new variant
# mid-serving (triton_kernels package docstring, "Variants").
@triton.jit(
    do_not_specialize_on_alignment=[
        "req_pool_indices", "seq_lens", "prefix_lens", "extend_lens", "extend_start"
    ]
)  # fmt: skip
def _extend_attn_kernel(
    Q,  # [num_tokens, H, D]
    K_buf,  # [pool_slots, Hkv, D]
    V_buf,  # [pool_slots, Hkv, D]
    Out,  # [num_tokens, H, D]
    req_to_token,  # [pool_rows, max_context_len] int32
    req_pool_indices,  # [bs]
    seq_lens,  # [bs]
    prefix_lens,  # [bs]
    extend_lens,  # [bs]
    extend_start,  # [bs]
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    ext = tl.load(extend_lens + b).to(tl.int32)
    if mb * BLOCK_M >= ext:
        return
    prefix = tl.load(prefix_lens + b).to(tl.int32)
    seq = tl.load(seq_lens + b).to(tl.int32)
    start = tl.load(extend_start + b).to(tl.int64)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < ext
    tok = start + offs_m.to(tl.int64)
    q = tl.load(
        Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    qpos = prefix + offs_m  # absolute position of each query

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys past the block's last query position are masked for every row: skip them.
    kv_end = tl.minimum(seq, prefix + (mb + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_valid, other=0)
        slots = slots.to(tl.int64)
        k = tl.load(
            K_buf + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        s = s * sm_scale
        attend = (offs_n[None, :] <= qpos[:, None]) & n_valid[None, :]
        s = tl.where(attend, s, float("-inf"))
        # Key 0 is in the first block and visible to every row, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V_buf + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        Out + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_valid[:, None],
    )


def extend_attention_fwd(
    q: torch.Tensor,  # [num_tokens, H, D]
    k_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    v_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    out: torch.Tensor,  # [num_tokens, H, D], written
    req_to_token: torch.Tensor,  # [pool_rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int
    seq_lens: torch.Tensor,  # [bs] int
    prefix_lens: torch.Tensor,  # [bs] int
    extend_lens: torch.Tensor,  # [bs] int
    extend_start: torch.Tensor,  # [bs] int, first token of request i in q/out
    max_extend_len: int,
    sm_scale: float,
    block_m: int = 32,
    block_n: int = 32,
) -> None:
    """Ragged causal GQA attention for an extend step; writes `out` in place.

    q/out rows must be unit-stride in the head_dim axis. Rows of requests with
    extend_lens[i] == 0 are untouched. H must be a multiple of Hkv.
    """
    bs, h, d = extend_lens.shape[0], q.shape[1], q.shape[2]
    hkv = k_buf.shape[1]
    if bs == 0 or max_extend_len == 0:
        return
    grid = (bs, h, triton.cdiv(max_extend_len, block_m))
    _extend_attn_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        prefix_lens,
        extend_lens,
        extend_start,
        sm_scale,
        *token_head_strides(q, k_buf, v_buf, out),
        req_to_token.stride(0),
        GROUP=h // hkv,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # float32 K/V: full-precision dots (no TF32), so fp32 matches the reference to 1e-4.
        DOT_PRECISION="ieee" if k_buf.dtype == torch.float32 else "tf32",
    )
