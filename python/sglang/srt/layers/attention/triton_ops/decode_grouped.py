"""GQA-grouped split-K decode attention (one query per request) over the paged KV pool, in Triton.

The per-head kernels of decode_attention.py run one program per (request, query head), so the
GROUP = H / Hkv query heads that share a KV head each read that head's keys and values: GROUP
reads of the same K/V (from L2 after the first). Here one program per (request, KV head,
split) loads the group's GROUP query rows once, padded to BLOCK_H >= 16 rows, and attends with
two tensor-core dots per BLOCK_N keys: S = Q K^T ([BLOCK_H, BLOCK_N]) and P V ([BLOCK_H, D]),
an online softmax in float32 between them (flash-decoding, Dao et al. 2023, "Flash-Decoding
for long-context inference", with the GQA grouping of FlashInfer's tensor-core decode).

Split s of request i covers keys [s * chunk, min((s + 1) * chunk, seq_len)) with chunk =
cdiv(cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, from the request's own length on the
device (so a short request leaves trailing splits empty: they write m = -inf, l = 0,
acc = 0), and the same merge kernel as the per-head split schedule combines them
(decode_attention._decode_attn_reduce_kernel). With NUM_SPLITS = 1 the program normalises and
writes the output itself: one kernel.

Why (issue 6, batch-1 decode of the Llama-3.1-8B shape on the H200): FlashInfer's tensor-core
decode took 8.7 us (prefill kernel) + 2.3 us (merge) per layer at ~300 tokens of context, where
one layer's K/V is under 1.6 MB, 0.35 ms of a 4.4 ms step; the graph decode also pays
FlashInfer's host plan before every replay. The split count is chosen per CUDA graph from
static shapes (grouped_decode_num_splits), never from the step's lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.triton_ops import token_head_strides
from sglang.srt.layers.triton_kernels.pdl import launch_args, pdl_wait
from sglang.srt.layers.triton_kernels.rmsnorm import round_to


@dataclass(frozen=True)
class DecodeRope:
    """The layer's RoPE and KV store, left to the grouped decode kernel (SGLANG_FUSED_ROPE_DECODE,
    layers/fused_rope_kv.decode_rope): q arrives unrotated, and each program rotates its
    group's query rows and its KV head's new key in registers, attends with the new key and
    value in place of the cache entry at position seq_len - 1 (which they would have
    overwritten), and the program whose split holds that position writes them to slot loc[i].
    Neox style over the whole head (rotary_dim == head_dim); the rounding is rotary.py's
    (rotate_halves), so q, the keys attended and the KV pool are bit for bit those of
    rope_kv.py's kernel followed by the decode kernel.

    positions: [bs] int (each token's position); cos_sin_cache: [max_position, D] float32
    [cos | sin]; k, v: [bs, Hkv * D] in q's dtype with a unit last stride (views of the fused
    qkv rows); loc: [bs] int (each token's KV slot, req_to_token[row, seq_len - 1])."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    loc: torch.Tensor


@dataclass(frozen=True)
class ExtendRows:
    """The token rows of a short ragged extend (a target verify of 1 + d_i tokens per request),
    each attended as a decode of its own position (SGLANG_TRITON_VERIFY_DECODE,
    TritonAttnBackend): row t belongs to the last request i with extend_start[i] <= t and
    attends that request's keys [0, prefix_lens[i] + t - extend_start[i] + 1), capped at
    seq_lens[i] (so rows past the last request's tokens, CUDA-graph token padding, attend its
    whole length: finite, never read). That is the causal mask of extend attention, where a
    query sees its request's keys up to its own position; the step's keys must be in the KV
    pool before the kernel runs.

    extend_start, prefix_lens: [bs] int on the kernel's device (extend_start non-decreasing);
    the kernel's req_pool_indices and seq_lens are then per request ([bs]), not per row."""

    extend_start: torch.Tensor
    prefix_lens: torch.Tensor


MAX_SPLITS = 32  # most KV splits per (request, KV head)
BLOCK_N = 32  # keys per tile, and the shortest non-empty split


def grouped_decode_num_splits(bs: int, num_kv_heads: int, num_sms: int | None) -> int:
    """KV splits per (request, KV head) for a decode step of bs requests: enough programs
    (bs * num_kv_heads * splits) to give every SM two, capped at MAX_SPLITS; 1 once
    bs * num_kv_heads alone fills that, or off CUDA (num_sms None). Static per CUDA graph:
    a function of the graph's batch bucket and the model's heads only. Short contexts use
    fewer splits on the device (a split holds at least BLOCK_N keys); the rest stay empty."""
    if num_sms is None or bs < 1 or num_kv_heads < 1:
        return 1
    programs = bs * num_kv_heads
    return max(1, min(MAX_SPLITS, (2 * num_sms) // programs))


@triton.jit
def _rotate_rows(x, partner, cos, sin, sgn, dtype: tl.constexpr):
    """Neox RoPE of whole-head rows: x [..., D] and partner = x with its halves swapped; cos,
    sin [D] float32 (rounded to dtype, repeated over both halves), sgn [D] -1 on the first half,
    +1 on the second. Rounds each product and the sum to dtype, as rotary.rotate_halves."""
    a = x.to(tl.float32)
    b = partner.to(tl.float32)
    o = round_to(a * cos, dtype).to(tl.float32) + round_to(sgn * b * sin, dtype).to(tl.float32)
    return round_to(o, dtype)


@triton.jit(  # index vectors: as extend_attention.py
    do_not_specialize_on_alignment=[
        "req_pool_indices",
        "seq_lens",
        "pos_ptr",
        "loc_ptr",
        "ext_start_ptr",
        "ext_prefix_ptr",
    ]
)
def _grouped_decode_kernel(
    Q,  # [bs, H, D]
    K_buf,  # [pool_slots, Hkv, D]
    V_buf,  # [pool_slots, Hkv, D]
    Out,  # [bs, H, D], written when NUM_SPLITS == 1
    Mid_o,  # [bs, H, NUM_SPLITS, D] float32, written when NUM_SPLITS > 1
    Mid_ml,  # [bs, H, NUM_SPLITS, 2] float32 (m, l), written when NUM_SPLITS > 1
    req_to_token,  # [pool_rows, max_context_len] int32
    req_pool_indices,  # [bs] (EXTEND_ROWS: [num_reqs], per request)
    seq_lens,  # [bs] (EXTEND_ROWS: [num_reqs], per request)
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
    num_heads,
    pos_ptr,  # FUSE_ROPE: [bs] positions
    loc_ptr,  # FUSE_ROPE: [bs] KV slots of the new tokens
    knew_ptr,  # FUSE_ROPE: [bs, Hkv * D] unrotated new keys (row stride stride_knew)
    vnew_ptr,  # FUSE_ROPE: [bs, Hkv * D] new values (row stride stride_vnew)
    cs_ptr,  # FUSE_ROPE: [max_position, D] float32 cos | sin
    stride_knew,
    stride_vnew,
    stride_cs,
    max_position,
    ext_start_ptr,  # EXTEND_ROWS: [num_reqs] first row of each request
    ext_prefix_ptr,  # EXTEND_ROWS: [num_reqs] cached KV length of each request
    num_reqs,  # EXTEND_ROWS: requests (the rows are tokens)
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP and >= 16 (a tensor-core dot's M)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before the first load
    FUSE_ROPE: tl.constexpr,  # DecodeRope: rotate q and the new key, store the new K / V
    ROPE_HALF: tl.constexpr,  # HEAD_DIM // 2
    EXTEND_ROWS: tl.constexpr,  # ExtendRows: row b is a token of a ragged extend
    REQS_P2: tl.constexpr,  # EXTEND_ROWS: next power of two >= num_reqs
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if EXTEND_ROWS:  # the last request whose first row is <= b (ExtendRows)
        offs_r = tl.arange(0, REQS_P2)
        starts = tl.load(ext_start_ptr + offs_r, mask=offs_r < num_reqs, other=2147483647)
        req = tl.maximum(tl.sum((starts <= b).to(tl.int32), 0) - 1, 0)
        first = tl.load(ext_start_ptr + req).to(tl.int32)
        own = tl.load(ext_prefix_ptr + req).to(tl.int32) + (b - first) + 1
        # at least one key: a padding row whose request holds none stays finite
        seq = tl.maximum(tl.minimum(own, tl.load(seq_lens + req).to(tl.int32)), 1)
        row = tl.load(req_pool_indices + req).to(tl.int64)
    else:
        seq = tl.load(seq_lens + b).to(tl.int32)
        row = tl.load(req_pool_indices + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = split * chunk
    end = tl.minimum(start + chunk, seq)

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [BLOCK_H] query heads of this KV head
    q_rows = Q + b * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=g_valid[:, None], other=0.0)  # [BLOCK_H, D]
    last = seq - 1  # the new token's position in the request's KV
    if FUSE_ROPE:
        dtype = Q.dtype.element_ty
        pos = tl.load(pos_ptr + b).to(tl.int64)
        pos = tl.where((pos >= 0) & (pos < max_position), pos, 0)  # as rotary.cos_sin_row
        partner = (offs_d + ROPE_HALF) % HEAD_DIM  # the other half's channel
        cs_row = cs_ptr + pos * stride_cs
        cos = round_to(tl.load(cs_row + offs_d % ROPE_HALF), dtype).to(tl.float32)
        sin = round_to(tl.load(cs_row + ROPE_HALF + offs_d % ROPE_HALF), dtype).to(tl.float32)
        sgn = tl.where(offs_d < ROPE_HALF, -1.0, 1.0)
        q_sw = tl.load(q_rows + partner[None, :], mask=g_valid[:, None], other=0.0)
        q = _rotate_rows(q, q_sw, cos[None, :], sin[None, :], sgn[None, :], dtype)
        k_row = knew_ptr + b * stride_knew + kvh * HEAD_DIM
        k_new = _rotate_rows(tl.load(k_row + offs_d), tl.load(k_row + partner), cos, sin, sgn,
                             dtype).to(K_buf.dtype.element_ty)  # fmt: skip
        v_new = tl.load(vnew_ptr + b * stride_vnew + kvh * HEAD_DIM + offs_d).to(
            V_buf.dtype.element_ty
        )
        if (start <= last) & (last < end):  # one split per (request, KV head) holds it
            slot = tl.load(loc_ptr + b).to(tl.int64)
            tl.store(K_buf + slot * stride_kt + kvh * stride_kh + offs_d, k_new)
            tl.store(V_buf + slot * stride_vt + kvh * stride_vh + offs_d, v_new)
    r2t_row = req_to_token + row * stride_r2t
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        slots = tl.load(r2t_row + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(
            K_buf + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        if FUSE_ROPE:  # the new key, not the cache entry it has not been written to yet
            k = tl.where((offs_n == last)[:, None], k_new[None, :], k)
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        s = tl.where(n_valid[None, :], s * sm_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile holds >= 1 valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V_buf + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        if FUSE_ROPE:
            v = tl.where((offs_n == last)[:, None], v_new[None, :], v)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            Out + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=g_valid[:, None],
        )
    else:
        part = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(Mid_o + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_valid[:, None])
        tl.store(Mid_ml + part * 2, m_i, mask=g_valid)
        tl.store(Mid_ml + part * 2 + 1, l_i, mask=g_valid)


def grouped_decode_stage1(
    q: torch.Tensor,  # [bs, H, D]
    k_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    v_buf: torch.Tensor,  # [pool_slots, Hkv, D]
    out: torch.Tensor,  # [bs, H, D], written when num_splits == 1
    partials: tuple[torch.Tensor, torch.Tensor] | None,  # (mid_o, mid_ml) when num_splits > 1
    req_to_token: torch.Tensor,  # [pool_rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int
    seq_lens: torch.Tensor,  # [bs] int, >= 1
    sm_scale: float,
    num_splits: int,
    block_n: int = BLOCK_N,
    rope: DecodeRope | None = None,
    rows: ExtendRows | None = None,
) -> None:
    """Launch the grouped kernel over a (bs, Hkv, num_splits) grid. num_splits == 1 writes
    `out`; otherwise the partials, which decode_attention's reduce kernel merges. Shapes and
    partials are checked by the caller (decode_attention.decode_attention_fwd). With `rope`,
    q is unrotated and the kernel does the layer's RoPE and KV store too (DecodeRope); raises
    ValueError when its tensors do not fit q and the caches. With `rows` (ExtendRows), q's bs
    rows are the tokens of a ragged extend, and req_pool_indices / seq_lens are per request;
    ValueError together with rope."""
    bs, h, d = q.shape
    hkv = k_buf.shape[1]
    group = h // hkv
    mid_o, mid_ml = partials if partials is not None else (out, out)  # unused when not split
    if rope is not None:
        _check_rope(rope, q, k_buf, v_buf)
        cs = rope.cos_sin_cache
        rope_args = (rope.positions, rope.loc, rope.k, rope.v, cs)
        rope_args += (rope.k.stride(0), rope.v.stride(0), cs.stride(0), cs.shape[0])
    else:
        rope_args = (seq_lens, seq_lens, q, q, q, 0, 0, 0, 0)  # not read
    if rows is not None:
        if rope is not None:
            raise ValueError("ExtendRows (a ragged extend's rows) cannot fuse RoPE")
        num_reqs = req_pool_indices.shape[0]
        row_args = (rows.extend_start, rows.prefix_lens, num_reqs)
    else:
        num_reqs = 1
        row_args = (seq_lens, seq_lens, 1)  # not read
    _grouped_decode_kernel[(bs, hkv, num_splits)](
        q,
        k_buf,
        v_buf,
        out,
        mid_o,
        mid_ml,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        *token_head_strides(q, k_buf, v_buf, out),
        req_to_token.stride(0),
        h,
        *rope_args,
        *row_args,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        # float32 K/V: full-precision dots (no TF32), so fp32 matches the reference to 1e-4
        DOT_PRECISION="ieee" if k_buf.dtype == torch.float32 else "tf32",
        **launch_args(q),
        FUSE_ROPE=rope is not None,
        ROPE_HALF=d // 2,
        EXTEND_ROWS=rows is not None,
        REQS_P2=max(2, triton.next_power_of_2(num_reqs)),
    )


def _check_rope(rope: DecodeRope, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor):
    bs, _, d = q.shape
    hkv = k_buf.shape[1]
    problems = []
    for name, t in (("k", rope.k), ("v", rope.v)):
        if t.shape != (bs, hkv * d) or t.stride(1) != 1 or t.dtype != q.dtype:
            problems.append(f"{name} {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    for name, t in (("positions", rope.positions), ("loc", rope.loc)):
        if t.shape != (bs,):
            problems.append(f"{name} {tuple(t.shape)}")
    cs = rope.cos_sin_cache
    if cs.dim() != 2 or cs.shape[1] != d or cs.dtype != torch.float32 or cs.stride(1) != 1:
        problems.append(f"cos_sin_cache {tuple(cs.shape)} {cs.dtype}")
    if d % 2 or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
        problems.append(f"head_dim {d}, caches {k_buf.dtype} / {v_buf.dtype} for q {q.dtype}")
    if problems:
        raise ValueError(
            f"DecodeRope for q {tuple(q.shape)} (bs, H, D) and {hkv} KV heads: expected k, v "
            f"[bs, Hkv * D] in q's dtype with unit last stride, positions and loc [bs], a "
            f"float32 [max_position, D] cos | sin cache, an even D, caches in q's dtype; got "
            + "; ".join(problems)
        )
