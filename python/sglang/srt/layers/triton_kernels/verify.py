"""Fused greedy chain verification: one program per request does what verify_greedy_rows
(speculative/verify.py) does with about fifteen torch calls, and writes the one buffer the
worker reads back.

Request i's verify rows start at row s_i of the step: [last token, d_i drafts]. Column j of its
output: the target argmax at row s_i + min(j, d_i); draft j (j < d_i) is the verify input at row
s_i + 1 + j. The accept length is the first j where draft j is missing or differs from the
target argmax (EAGLE greedy verification; arXiv 2401.15077, section 3), and the output keeps
columns j <= accept length (the accepted drafts, then the bonus token), -1 after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["starts_ptr", "lens_ptr"])  # package docstring
def _verify_greedy_kernel(
    predict_ptr,  # [R] int64 target argmax of every verify row
    ids_ptr,  # [R] int64 verify input (each request: its last token, then its drafts)
    starts_ptr,  # [bs] int64 first verify row of each request
    lens_ptr,  # [bs] int64 draft length d_i
    out_ptr,  # [bs, width + 1] int64: accept length, then the output ids
    width,  # max d_i + 1
    BLOCK: tl.constexpr,  # power of two >= width
):
    i = tl.program_id(0)
    s = tl.load(starts_ptr + i)
    d = tl.load(lens_ptr + i)
    j = tl.arange(0, BLOCK)
    in_row = j < width
    target = tl.load(predict_ptr + s + tl.minimum(j, d), mask=in_row, other=-1)
    is_draft = j < d
    draft = tl.load(ids_ptr + s + 1 + j, mask=is_draft, other=-1)
    match = is_draft & (draft == target)
    accepted = tl.min(tl.where(match, BLOCK, j), axis=0)  # first miss (<= d_i)
    row = out_ptr + i * (width + 1)
    tl.store(row, accepted.to(tl.int64))
    tl.store(row + 1 + j, tl.where(j <= accepted, target, -1), mask=in_row)


def verify_greedy_fused(
    predict: torch.Tensor,
    verify_ids: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Greedy verification of a ragged verify batch in one kernel.

    Args:
        predict: [R] int64 target argmax ids of the verify rows (R = sum (d_i + 1)).
        verify_ids: [R] int64 verify input (request i: its last token, then its d_i drafts).
        starts: [bs] int64 first verify row of each request; lens: [bs] int64 d_i >= 0.
        width: max d_i + 1 (>= 1).
    Returns:
        [bs, width + 1] int64: column 0 the accept length a_i, columns 1.. the output ids
        (a_i accepted drafts, then the bonus token, then -1), i.e. VerifyOutput's num_accepted
        and output_ids side by side, on predict's device.
    """
    bs = starts.numel()
    out = torch.empty((bs, width + 1), dtype=torch.int64, device=predict.device)
    if bs:
        block = triton.next_power_of_2(width)
        _verify_greedy_kernel[(bs,)](predict, verify_ids, starts, lens, out, width, BLOCK=block)
    return out
