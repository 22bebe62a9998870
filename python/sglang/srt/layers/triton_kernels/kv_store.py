"""Write one layer's new K and V rows into the token-indexed KV pool with one kernel.

Semantics of ``MHATokenToKVPool.set_kv_buffer``'s PyTorch path (``k_cache[loc] = k``,
``v_cache[loc] = v``: two indexed writes, two kernels per layer and step): row t of k and of v
goes to slot loc[t] of the caches, cast to the cache dtype. Duplicate slots (CUDA-graph padding
writes every pad token to slot 0) leave one of the rows there, as the indexed write does. One
program per (token, column block) copies both rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels.rotary import _token_rows

_BLOCK = 1024


@triton.jit(do_not_specialize_on_alignment=["loc_ptr"])  # package docstring: variants
def _store_kv_kernel(
    loc_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_stride,
    v_stride,
    row,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row
    slot = tl.load(loc_ptr + token).to(tl.int64)
    dtype = k_cache_ptr.dtype.element_ty
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * row + cols, k.to(dtype), mask=mask)
    tl.store(v_cache_ptr + slot * row + cols, v.to(dtype), mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache[loc] = k and v_cache[loc] = v in one launch.

    k_cache, v_cache: [slots, H, D] contiguous, same dtype; loc: [T] int32/int64 slot indices
    (in range: not checked); k, v: [T, H, D] (any float dtype, cast to the cache dtype; rows
    may be strided). Raises ValueError on shape mismatches or a non-contiguous cache.
    """
    num_tokens = loc.shape[0]
    if k.shape[0] != num_tokens or v.shape[0] != num_tokens:
        raise ValueError(f"store_kv: {num_tokens} slots for k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("store_kv: k and v caches differ in shape or dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: the caches must be contiguous")
    row = k_cache[0].numel() if k_cache.shape[0] else 0
    if num_tokens == 0 or row == 0:
        return
    # [T, H * D] with a unit last stride (a view of strided qkv rows when possible)
    k_rows, v_rows = _token_rows(k, num_tokens)[0], _token_rows(v, num_tokens)[0]
    if k_rows.shape[1] != row or v_rows.shape[1] != row:
        raise ValueError(
            f"store_kv: rows of {k_rows.shape[1]} / {v_rows.shape[1]} values for cache rows "
            f"of {row}"
        )
    block = min(_BLOCK, triton.next_power_of_2(row))
    grid = (num_tokens, triton.cdiv(row, block))
    _store_kv_kernel[grid](
        loc, k_rows, v_rows, k_cache, v_cache, k_rows.stride(0), v_rows.stride(0), row,
        BLOCK=block,
    )  # fmt: skip
