"""The page-size-1 layout of one attention step, shared by paged attention backends
(FlashInfer): host-side indptrs from the step's lengths (paged_layout) and the concatenated
page lists gathered on the device from req_to_token (fill_kv_indices, one Triton kernel,
no host sync).

Token rows beyond the last request (a CUDA-graph bucket may hold more rows than the step
uses) are given to the last request together with as many extra pages pointing at padding
slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl


@dataclass
class PagedLayout:
    """Host-side page layout of one step (page size 1; all tensors int32 on the CPU)."""

    qo_indptr: torch.Tensor  # [bs + 1], query rows of request i: qo_indptr[i] .. qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [bs + 1], pages of request i: kv_indptr[i] .. kv_indptr[i+1]
    last_page_len: torch.Tensor  # [bs], all ones (every page holds one token)
    extra_rows: int  # token rows beyond sum(extend lens), appended to the last request
    num_pages: int  # kv_indptr[-1]
    is_decode: bool  # one query per request and no extra rows


def paged_layout(seq_lens: list[int], extend_lens: list[int], num_tokens: int) -> PagedLayout:
    """Layout of a step whose request i computes extend_lens[i] of its seq_lens[i] tokens, in a
    token stream of num_tokens rows (>= sum(extend_lens)). Raises ValueError otherwise. Built
    with numpy (torch.from_numpy shares the arrays): every replay of a graph step makes one,
    and the host is what a small model's decode step waits on."""
    bs = len(seq_lens)
    ext = np.asarray(extend_lens, dtype=np.int32)
    extra = num_tokens - int(ext.sum())
    if bs == 0 or len(ext) != bs or extra < 0:
        raise ValueError(
            f"bad step layout: {bs} requests, {int(ext.sum())} extend tokens, "
            f"{num_tokens} token rows"
        )
    kv = np.asarray(seq_lens, dtype=np.int32)
    is_decode = extra == 0 and bool((ext == 1).all())
    qo_indptr = np.zeros(bs + 1, dtype=np.int32)
    kv_indptr = np.zeros(bs + 1, dtype=np.int32)
    np.cumsum(ext, out=qo_indptr[1:])
    np.cumsum(kv, out=kv_indptr[1:])
    qo_indptr[-1] += extra
    kv_indptr[-1] += extra
    return PagedLayout(
        qo_indptr=torch.from_numpy(qo_indptr),
        kv_indptr=torch.from_numpy(kv_indptr),
        last_page_len=_ones_int32(bs),
        extra_rows=extra,
        num_pages=int(kv_indptr[-1]),
        is_decode=is_decode,
    )


_ONES: dict[int, torch.Tensor] = {}


def _ones_int32(n: int) -> torch.Tensor:
    """[n] int32 ones on the host, one shared tensor per n (read only: FlashInfer copies it)."""
    t = _ONES.get(n)
    if t is None:
        t = _ONES[n] = torch.ones(n, dtype=torch.int32)
    return t


# One compiled variant per request table: Triton specializes integer arguments on their value
# (== 1, divisible by 16) and pointers on 16-byte alignment, so a kernel whose per-step
# arguments vary compiles a new variant whenever a new combination shows up, mid-serving
# (0.2-0.5 s each).
# `bs` and `extra_rows` change every step, and req_pool_indices / seq_lens are views at
# offsets that change with the step's shape (int64_to_device's split), so none of them is
# specialized; the prefix sum walks fixed PREFIX_BLOCK tiles instead of a power of two >= bs.
# `stride_r2t` stays specialized: one value per request table, so one variant each.
# On the H200 (fifteenth session, py-spy of a paired run at c = 256) the adaptive server's
# scheduler thread spent ~8% of its busy samples compiling variants of the earlier kernel
# (a BS_POW2 constexpr, specialized integers), in eager prefills and verify replays.
@triton.jit(
    do_not_specialize=["extra_rows", "bs"],
    do_not_specialize_on_alignment=["req_pool_indices", "seq_lens"],
)
def _fill_kv_indices_kernel(
    req_to_token,  # [pool_rows, max_context_len] int32
    stride_r2t,
    req_pool_indices,  # [bs] int
    seq_lens,  # [bs] int
    kv_indices,  # [num_pages] int32, output
    extra_rows,
    bs,
    PREFIX_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * 0  # exclusive prefix sum of seq_lens, PREFIX_BLOCK at a time
    for j0 in range(0, pid, PREFIX_BLOCK):
        offs_b = j0 + tl.arange(0, PREFIX_BLOCK)
        before = tl.load(seq_lens + offs_b, mask=offs_b < pid, other=0).to(tl.int64)
        start += tl.sum(before, axis=0)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    n_valid = tl.load(seq_lens + pid).to(tl.int32)
    n_total = n_valid + tl.where(pid == bs - 1, extra_rows, 0)
    for n0 in range(0, n_total, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        slots = tl.load(req_to_token + row * stride_r2t + offs, mask=offs < n_valid, other=0)
        tl.store(kv_indices + start + offs, slots, mask=offs < n_total)


def fill_kv_indices(
    req_to_token: torch.Tensor,  # [pool_rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64
    extra_rows: int,
    kv_indices: torch.Tensor,  # [>= sum(seq_lens) + extra_rows] int32, written in place
) -> None:
    """Page lists of a step, concatenated: req_to_token[req_pool_indices[i], :seq_lens[i]] for
    each request, then extra_rows zeros (padding slot 0) after the last one. One program per
    request, lengths read on the device (no host sync); one compiled kernel whatever bs,
    extra_rows and the index vectors' offsets (see the kernel's note)."""
    bs = req_pool_indices.numel()
    _fill_kv_indices_kernel[(bs,)](
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        seq_lens,
        kv_indices,
        extra_rows,
        bs,
        PREFIX_BLOCK=128,
        BLOCK=512,
    )
