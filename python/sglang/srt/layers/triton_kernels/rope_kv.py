"""RoPE on q and k fused with the KV-cache store of k and v: one launch instead of two.

Semantics: ``rotary_embedding_(positions, q, k, ...)`` (rotary.py: neox style, in place, the
first rotary_dim channels of each head, cos/sin from the float32 cache rounded to q's dtype)
followed by ``store_kv(k_cache, v_cache, loc, k, v)`` (kv_store.py: row t of the rotated k and
of v to slot loc[t], cast to the cache dtype). The arithmetic is the same (rotary.py's
``cos_sin_row`` and ``_rope_heads``), so the results are bit for bit those of the two kernels.

Grid (tokens, 3): per token, program 0 rotates q's heads in place; program 1 rotates k's heads
in place and writes them (with the channels past rotary_dim) to the key cache; program 2 copies
v's row to the value cache. The three run side by side, so a batch-1 step's latency is the
largest part's, not their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.pdl import launch_args, pdl_wait
from sglang.srt.layers.triton_kernels.rotary import (
    _rope_heads,
    _token_rows,
    check_rope_args,
    cos_sin_row,
    heads_of,
    write_back_rows,
)


@triton.jit
def _copy_heads(src_ptr, dst_ptr, num_heads, HEAD_SIZE: tl.constexpr, START: tl.constexpr,
                WIDTH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """Channels [START, START + WIDTH) of each of num_heads heads (head stride HEAD_SIZE), cast
    to dst's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = START + tl.arange(0, BLOCK_W)[None, :]
    mask = (heads < num_heads) & (dims < START + WIDTH)
    offs = heads * HEAD_SIZE + dims
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "loc_ptr"])  # package docstring: variants
def _rope_store_kv_kernel(
    pos_ptr,
    loc_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_stride,
    k_stride,
    v_stride,
    cache_stride,
    num_q_heads,
    num_kv_heads,
    max_position,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HEAD: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.py: launched with PDL, wait before the first load
):
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # 0: q, 1: k, 2: v
    row = num_kv_heads * HEAD_SIZE  # one slot of a [slots, Hkv, D] contiguous cache
    if part == 2:
        slot = tl.load(loc_ptr + token).to(tl.int64)
        _copy_heads(v_ptr + token * v_stride, v_cache_ptr + slot * row, num_kv_heads, HEAD_SIZE,
                    0, HEAD_SIZE, BLOCK_HK, BLOCK_HEAD)  # fmt: skip
    else:
        cos, sin = cos_sin_row(pos_ptr, cache_ptr, token, cache_stride, max_position,
                               q_ptr.dtype.element_ty, HALF, BLOCK_HALF)  # fmt: skip
        if part == 0:
            q_row = q_ptr + token * q_stride
            _rope_heads(q_row, num_q_heads, cos, sin, q_row, HEAD_SIZE, HALF, BLOCK_HQ,
                        BLOCK_HALF, False)  # fmt: skip
        else:
            slot = tl.load(loc_ptr + token).to(tl.int64)
            k_row = k_ptr + token * k_stride
            dst = k_cache_ptr + slot * row
            # k rotated in place, as rotary_embedding_ leaves it, and into its cache slot
            _rope_heads(k_row, num_kv_heads, cos, sin, dst, HEAD_SIZE, HALF, BLOCK_HK,
                        BLOCK_HALF, True)  # fmt: skip
            if HEAD_SIZE > 2 * HALF:  # partial rotary: the rest of each head as it is
                _copy_heads(k_row, dst, num_kv_heads, HEAD_SIZE, 2 * HALF, HEAD_SIZE - 2 * HALF,
                            BLOCK_HK, BLOCK_REST)  # fmt: skip


def rope_and_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply neox-style RoPE to query and key in place, write the rotated key and the value to
    slot loc[t] of k_cache / v_cache, and return (query, key).

    positions: [T] int32/int64; query: [T, Hq * head_size] (or [T, Hq, head_size]); key, value:
    [T, Hkv * head_size] (or 3-D), key in query's dtype; rows may be strided views of a fused
    qkv. cos_sin_cache: [max_position, rotary_dim] float32 ([cos | sin]). k_cache, v_cache:
    [slots, Hkv, head_size] contiguous, same dtype (k and v are cast to it); loc: [T]
    int32/int64 slots. Neither positions nor slots are range-checked (an out-of-range position
    reads cache row 0, as in rotary_embedding_). Duplicate slots keep one of their rows.
    No host synchronisation and no value-dependent allocation: safe under CUDA-graph capture.
    Raises ValueError on an odd rotary_dim or one > head_size, mismatched dtypes, token
    counts, widths or cache shapes, or non-contiguous caches.
    """
    num_tokens = positions.shape[0]
    check_rope_args(query, key, cos_sin_cache, head_size, rotary_dim)
    if loc.shape[0] != num_tokens or value.shape[0] != num_tokens:
        raise ValueError(
            f"rope_and_store_kv: {num_tokens} positions for {loc.shape[0]} slots and "
            f"{value.shape[0]} value rows"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("rope_and_store_kv: k and v caches differ in shape or dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_store_kv: the caches must be contiguous")
    if num_tokens == 0:
        return query, key
    q_rows, q_copy = _token_rows(query, num_tokens)
    k_rows, k_copy = _token_rows(key, num_tokens)
    v_rows = _token_rows(value, num_tokens)[0]
    num_q_heads, num_kv_heads = heads_of(q_rows, k_rows, head_size)
    if v_rows.shape[1] != k_rows.shape[1] or tuple(k_cache.shape[1:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"rope_and_store_kv: key rows of {k_rows.shape[1]}, value rows of "
            f"{v_rows.shape[1]}, caches of shape {tuple(k_cache.shape)}"
        )
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = rotary_dim // 2
    if num_kv_heads > 0:
        rest = head_size - rotary_dim
        _rope_store_kv_kernel[(num_tokens, 3)](
            positions,
            loc,
            q_rows,
            k_rows,
            v_rows,
            cache,
            k_cache,
            v_cache,
            q_rows.stride(0),
            k_rows.stride(0),
            v_rows.stride(0),
            cache.stride(0),
            num_q_heads,
            num_kv_heads,
            cache.shape[0],
            HEAD_SIZE=head_size,
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
            BLOCK_HQ=triton.next_power_of_2(max(num_q_heads, 1)),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HEAD=triton.next_power_of_2(head_size),
            BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
            **launch_args(q_rows),
        )
    return write_back_rows(query, key, q_rows, k_rows, q_copy, k_copy)
