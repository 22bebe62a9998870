"""Neox-style rotary embedding (RoFormer, Su et al. 2021) applied in place to q and k.

Semantics of ``RotaryEmbedding.forward`` in layers/rotary_embedding.py: for each head, the
first rotary_dim channels [x1 | x2] become [x1*cos - x2*sin | x2*cos + x1*sin], with cos/sin
read from the float32 [cos | sin] cache at each token's position and rounded to q's dtype;
the channels past rotary_dim are left untouched. One program per token handles all heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.rmsnorm import round_to


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """(x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin) in x1's dtype; cos/sin float32 values
    already rounded to that dtype. Each product and sum is rounded to the dtype, as the
    elementwise PyTorch path does (rope_kv.py shares this, so both kernels agree bit for bit)."""
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o1 = round_to(a * cos, dtype).to(tl.float32) + round_to(-b * sin, dtype).to(tl.float32)
    o2 = round_to(b * cos, dtype).to(tl.float32) + round_to(a * sin, dtype).to(tl.float32)
    return round_to(o1, dtype), round_to(o2, dtype)


@triton.jit
def _rope_heads(base_ptr, num_heads, cos, sin, dst_ptr, HEAD_SIZE: tl.constexpr,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                TO_DST: tl.constexpr):  # fmt: skip
    """Rotate the first 2 * HALF channels of num_heads heads at base_ptr in place; with TO_DST
    also write them, cast to dst's dtype, at the same offsets from dst_ptr (rope_kv.py's key
    cache slot; dst_ptr is not read otherwise)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    offs = heads * HEAD_SIZE + dims
    x1 = tl.load(base_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(base_ptr + offs + HALF, mask=mask, other=0.0)
    o1, o2 = rotate_halves(x1, x2, cos, sin)
    tl.store(base_ptr + offs, o1, mask=mask)
    tl.store(base_ptr + offs + HALF, o2, mask=mask)
    if TO_DST:
        dst_dtype = dst_ptr.dtype.element_ty
        tl.store(dst_ptr + offs, o1.to(dst_dtype), mask=mask)
        tl.store(dst_ptr + offs + HALF, o2.to(dst_dtype), mask=mask)


@triton.jit
def cos_sin_row(pos_ptr, cache_ptr, token, cache_stride, max_position, dtype: tl.constexpr,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """cos, sin of token's position: [1, BLOCK_HALF] float32 holding values rounded to dtype
    (the PyTorch path casts the float32 cache rows to q's dtype). Out-of-range positions read
    row 0 instead of faulting (the PyTorch path raises)."""
    pos = tl.load(pos_ptr + token).to(tl.int64)
    pos = tl.where((pos >= 0) & (pos < max_position), pos, 0)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + dims, mask=dmask, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + dims, mask=dmask, other=0.0)
    cos = round_to(cos, dtype).to(tl.float32)[None, :]
    sin = round_to(sin, dtype).to(tl.float32)[None, :]
    return cos, sin


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])  # package docstring: variants
def _rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_stride,
    k_stride,
    cache_stride,
    num_q_heads,
    num_k_heads,
    max_position,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = cos_sin_row(pos_ptr, cache_ptr, token, cache_stride, max_position,
                           q_ptr.dtype.element_ty, HALF, BLOCK_HALF)  # fmt: skip
    q_row = q_ptr + token * q_stride
    k_row = k_ptr + token * k_stride
    _rope_heads(q_row, num_q_heads, cos, sin, q_row, HEAD_SIZE, HALF, BLOCK_HQ, BLOCK_HALF,
                False)  # fmt: skip
    _rope_heads(k_row, num_k_heads, cos, sin, k_row, HEAD_SIZE, HALF, BLOCK_HK, BLOCK_HALF,
                False)  # fmt: skip


def _token_rows(t: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, bool]:
    """[T, ...] -> ([T, rest] with unit last stride, whether it is a copy to write back)."""
    if t.dim() >= 1 and t.shape[0] == num_tokens:
        try:
            rows = t.view(num_tokens, -1)
            if rows.stride(-1) == 1 or rows.shape[1] <= 1:
                return rows, False
        except RuntimeError:
            pass
    return t.reshape(num_tokens, -1).contiguous(), True


def write_back_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    q_copy: bool,
    k_copy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """After a kernel rotated the rows of _token_rows(query) / _token_rows(key) in place:
    copy the rows that were copies back into the caller's tensors. Returns (query, key)."""
    if q_copy:
        query.copy_(q_rows.view(query.shape))
    if k_copy:
        key.copy_(k_rows.view(key.shape))
    return query, key


def check_rope_args(
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
) -> None:
    """The argument checks of a RoPE launch (rotary_embedding_, rope_kv.rope_and_store_kv).
    Raises ValueError on an odd rotary_dim or one > head_size, query and key dtypes that
    differ, or a cache whose last dim is not rotary_dim."""
    if rotary_dim % 2 != 0 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
    if query.dtype != key.dtype:
        raise ValueError(f"query dtype {query.dtype} != key dtype {key.dtype}")
    if cos_sin_cache.shape[-1] != rotary_dim:
        raise ValueError(f"cos_sin_cache last dim {cos_sin_cache.shape[-1]} != {rotary_dim}")


def heads_of(q_rows: torch.Tensor, k_rows: torch.Tensor, head_size: int) -> tuple[int, int]:
    """(query heads, key heads) of [T, width] rows. Raises ValueError when a width is not a
    multiple of head_size."""
    if q_rows.shape[1] % head_size != 0 or k_rows.shape[1] % head_size != 0:
        raise ValueError(f"query/key widths are not multiples of head_size {head_size}")
    return q_rows.shape[1] // head_size, k_rows.shape[1] // head_size


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply neox-style RoPE to query and key in place and return them.

    positions: [T] int32/int64 token positions; query: [T, Hq * head_size] (or [T, Hq,
    head_size]); key: [T, Hk * head_size], same dtype as query; cos_sin_cache: [max_position,
    rotary_dim] float32 ([cos | sin]). Rows may be strided views (q/k split from a fused qkv).
    Positions outside [0, max_position) are not checked (they read row 0).
    Raises ValueError on inconsistent shapes or an odd rotary_dim > head_size.
    """
    num_tokens = positions.shape[0]
    check_rope_args(query, key, cos_sin_cache, head_size, rotary_dim)
    q_rows, q_copy = _token_rows(query, num_tokens)
    k_rows, k_copy = _token_rows(key, num_tokens)
    num_q_heads, num_k_heads = heads_of(q_rows, k_rows, head_size)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = rotary_dim // 2
    if num_tokens > 0 and half > 0:
        _rope_kernel[(num_tokens,)](
            positions,
            q_rows,
            k_rows,
            cache,
            q_rows.stride(0),
            k_rows.stride(0),
            cache.stride(0),
            num_q_heads,
            num_k_heads,
            cache.shape[0],
            HEAD_SIZE=head_size,
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(max(num_q_heads, 1)),
            BLOCK_HK=triton.next_power_of_2(max(num_k_heads, 1)),
        )
    return write_back_rows(query, key, q_rows, k_rows, q_copy, k_copy)
