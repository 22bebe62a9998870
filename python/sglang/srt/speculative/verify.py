"""Verification step of chain speculative decoding (EAGLE with topk = 1).

A request proposes d draft tokens x_0 .. x_{d-1}. The target model runs once over
[last_token, x_0, .., x_{d-1}] (ForwardMode.TARGET_VERIFY) and yields d + 1 rows: row j scores
the token at draft position j, row d the position after the last draft (the bonus position).
Verification keeps the longest acceptable prefix of the draft and appends one token drawn from the
target (the bonus token), so a step emits between 1 and d + 1 tokens.

Each algorithm is written twice: a small per-request reference in plain Python/torch with the
acceptance rule next to the code, and a batched ragged version (vectorised over requests, no
Python loop over tokens) that the tests check against the reference.

Batched (ragged) layout, as the engine builds it for bs requests with draft lengths d_i >= 0:
    draft_tokens [sum d_i] int64          request i's drafts contiguous, requests in order
    draft_lens   [bs] int (any int dtype)  d_i
    target rows  [sum (d_i + 1), ...]      request i: its d_i draft rows, then its bonus row
    q            [sum d_i, V] float        draft probs, aligned with draft_tokens
    uniforms     [sum (d_i + 1)] float     aligned with the target rows; bonus rows unused
Result (VerifyOutput):
    output_ids   [bs, max_d + 1] int64     row i: the num_accepted_i accepted drafts, then the
                                           bonus token, then -1 padding
    num_accepted [bs] int64                accept length, in [0, d_i]
Flattened: output_ids[output_ids >= 0] lists every request's tokens in order, request i owning
num_accepted_i + 1 of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# (probs [V] float32, j = index of the drawn token in this step's output) -> token id
RowSampleFn = Callable[[torch.Tensor, int], int]
# (probs [bs, V] float32, steps [bs] int64 = index of the drawn token in each request's output
# of this step, i.e. num_accepted) -> [bs] int64 token ids
BatchSampleFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class VerifyOutput(NamedTuple):
    output_ids: torch.Tensor  # [bs, max_d + 1] int64: accepted drafts + bonus, -1 padded
    num_accepted: torch.Tensor  # [bs] int64: accepted draft tokens per request


# ------------------------------------------------------------------------------ references
def verify_greedy_reference(
    draft_tokens: list[int], target_argmax: list[int]
) -> tuple[list[int], int]:
    """Greedy chain verification of one request (reference).

    Args:
        draft_tokens: the d draft ids.
        target_argmax: d + 1 ids, argmax of the target at each verify position.
    Returns:
        (tokens, num_accepted): tokens = the accepted drafts followed by the bonus token
        target_argmax[num_accepted] (num_accepted + 1 ids).
    Raises:
        ValueError: if len(target_argmax) != len(draft_tokens) + 1.
    """
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"need {len(draft_tokens) + 1} target ids, got {len(target_argmax)}")
    num_accepted = 0
    for x, t in zip(draft_tokens, target_argmax, strict=False):
        # x_j survives iff it is exactly what the greedy target would have emitted at j.
        if x != t:
            break
        num_accepted += 1
    # Bonus: the target's own choice at the first mismatch (or after the last draft).
    return list(draft_tokens[:num_accepted]) + [target_argmax[num_accepted]], num_accepted


def speculative_sample_reference(
    draft_tokens: list[int],
    q: torch.Tensor,
    p: torch.Tensor,
    uniforms: torch.Tensor,
    sample_fn: RowSampleFn,
) -> tuple[list[int], int]:
    """Speculative sampling of one request (reference).

    Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
    Decoding" (arXiv 2211.17192), Algorithm 1; Chen et al. 2023 (arXiv 2302.01318). The emitted
    tokens are distributed exactly as if sampled one by one from p.

    Args:
        draft_tokens: the d draft ids, x_j drawn from q[j].
        q: [d, V] draft probabilities at each draft position.
        p: [d + 1, V] target probabilities, already processed by the caller (temperature, top-k,
            top-p, min-p, penalties); row d is the bonus position.
        uniforms: [d + 1] floats in (0, 1); uniforms[j] is the accept test of x_j (uniforms[d]
            is unused, it keeps the layout aligned with p).
        sample_fn: (probs [V], j) -> id, draws the residual or bonus token at output index j.
    Returns:
        (tokens, num_accepted): num_accepted accepted drafts followed by one sampled token.
    Raises:
        ValueError: on inconsistent shapes.
    """
    d = len(draft_tokens)
    if q.shape[0] != d or p.shape[0] != d + 1 or uniforms.shape[0] != d + 1:
        raise ValueError(
            f"d={d}: q {tuple(q.shape)}, p {tuple(p.shape)}, u {tuple(uniforms.shape)}"
        )
    q, p, uniforms = q.float(), p.float(), uniforms.float()
    tokens: list[int] = []
    for j, x in enumerate(draft_tokens):
        p_x, q_x = p[j, x], q[j, x]
        # Accept x with probability min(1, p(x) / q(x)): u < p/q (always true when p >= q).
        # q(x) = 0 cannot happen when x ~ q; guard: then accept iff the target allows x at all.
        accept = bool(p_x > 0) if q_x == 0 else bool(uniforms[j] < p_x / q_x)
        if not accept:
            # First rejection: draw from the residual norm(max(p - q, 0)) and stop. This is the
            # correction that makes the emitted token exactly ~ p (Leviathan et al., Theorem 1).
            residual = torch.clamp(p[j] - q[j], min=0.0)
            if residual.sum() <= 0:
                # p <= q everywhere means p == q: only a guard case can reject; fall back to p.
                residual = p[j]
            tokens.append(int(sample_fn(residual / residual.sum(), j)))
            return tokens, j
        tokens.append(int(x))
    # All d drafts accepted: the bonus token comes from the target's last row.
    tokens.append(int(sample_fn(p[d], d)))
    return tokens, d


# ----------------------------------------------------------------------------- ragged layout
class _Layout(NamedTuple):
    bs: int
    max_d: int
    lens: torch.Tensor  # [bs] int64, d_i
    draft_starts: torch.Tensor  # [bs] int64, first draft row of request i
    target_starts: torch.Tensor  # [bs] int64, first target row of request i


def _layout(
    draft_lens: torch.Tensor, num_draft: int, num_target: int, host_lens: list[int] | None
) -> _Layout:
    """Offsets of the ragged layout; checks the row counts. host_lens: the same d_i as a host
    list (then nothing is read back from the device); None: one host sync reads them."""
    if draft_lens.dim() != 1:
        raise ValueError(f"draft_lens must be 1-D, got shape {tuple(draft_lens.shape)}")
    lens = draft_lens.long()  # [bs] int64
    bs = lens.numel()
    total, max_d, min_d = 0, 0, 0
    if host_lens is not None:
        if len(host_lens) != bs:
            raise ValueError(f"host_lens has {len(host_lens)} entries for {bs} requests")
        if bs > 0:
            total, max_d, min_d = sum(host_lens), max(host_lens), min(host_lens)
    elif bs > 0:
        total, max_d, min_d = torch.stack([lens.sum(), lens.max(), lens.min()]).tolist()
    if min_d < 0:
        raise ValueError("draft_lens must be >= 0")
    if num_draft != total or num_target != total + bs:
        raise ValueError(
            f"sum(draft_lens)={total}, bs={bs}: expected {total} draft rows and {total + bs} "
            f"target rows, got {num_draft} and {num_target}"
        )
    draft_starts = torch.cumsum(lens, 0) - lens  # [bs] int64
    target_starts = draft_starts + torch.arange(bs, device=lens.device)  # [bs] int64
    return _Layout(bs, max_d, lens, draft_starts, target_starts)


def _gather_padded(
    flat: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, width: int, fill: int
) -> torch.Tensor:
    """[sum lens] -> [bs, width]: row i = flat[starts[i] : starts[i] + lens[i]], then `fill`."""
    cols = torch.arange(width, device=flat.device).view(1, -1)  # [1, width]
    valid = cols < lens.view(-1, 1)  # [bs, width]
    if flat.numel() == 0:
        return torch.full(valid.shape, fill, dtype=flat.dtype, device=flat.device)
    idx = torch.where(valid, starts.view(-1, 1) + cols, 0)  # [bs, width]
    return flat[idx].masked_fill(~valid, fill)


# ---------------------------------------------------------------------------- batched greedy
def verify_greedy(
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    target_predict: torch.Tensor,
) -> VerifyOutput:
    """Greedy chain verification of a ragged batch (batched `verify_greedy_reference`; the
    engine runs verify_greedy_rows, the same rule with its indices built on the host).

    Args:
        draft_tokens: [sum d_i] int64.
        draft_lens: [bs] int, d_i >= 0 (0: the output is just the target's argmax).
        target_predict: [sum (d_i + 1)] int64 target argmax ids, or [sum (d_i + 1), V] target
            logits (argmax taken here; ties go to the lowest id, as torch.argmax).
    Returns:
        VerifyOutput (see the module docstring for the layout).
    Raises:
        ValueError: on inconsistent row counts or negative lengths.
    """
    if target_predict.dim() == 2:
        target_predict = torch.argmax(target_predict, dim=-1)  # [sum (d_i + 1)] int64
    lay = _layout(draft_lens, draft_tokens.numel(), target_predict.shape[0], None)
    width = lay.max_d + 1
    draft = _gather_padded(draft_tokens.long(), lay.draft_starts, lay.lens, width, -1)
    target = _gather_padded(target_predict.long(), lay.target_starts, lay.lens + 1, width, -1)
    cols = torch.arange(width, device=draft.device).view(1, -1)  # [1, max_d + 1]
    # x_j survives iff it equals the target argmax at j and every earlier draft survived.
    match = (draft == target) & (cols < lay.lens.view(-1, 1))  # [bs, max_d + 1]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [bs] int64
    # Accepted drafts equal the target's argmax, so the output is the target's argmax prefix of
    # length num_accepted + 1, its last id being the bonus token.
    output_ids = target.masked_fill(cols > num_accepted.view(-1, 1), -1)  # [bs, max_d + 1]
    return VerifyOutput(output_ids, num_accepted)


def greedy_rows(draft_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Host-built gather indices of verify_greedy_rows for requests with draft lengths d_i,
    laid out [bs, W] row-major (W = max d_i + 1; flattened lists of bs * W ints):
    target rows: request i's verify row min(j, d_i) (row j scores the token after draft j - 1);
    draft rows: the verify-input row of draft j (1 + min(j, d_i - 1) past the request's first
    row; the first row itself when d_i = 0); valid: 1 where j < d_i. Rows count from 0 at the
    first request's first verify token."""
    width = max(draft_lens, default=0) + 1
    target, draft, valid = [], [], []
    start = 0
    for d in draft_lens:
        for j in range(width):
            target.append(start + min(j, d))
            draft.append(start + 1 + min(j, d - 1) if d > 0 else start)
            valid.append(1 if j < d else 0)
        start += d + 1
    return target, draft, valid


def greedy_fused_applies(device: torch.device) -> bool:
    """The worker verifies greedy steps with the fused kernel (verify_greedy_fused in
    layers/triton_kernels/verify.py, the per-request layout instead of greedy_rows' lists):
    the Triton kernels are enabled and the step runs on CUDA."""
    from sglang.srt.layers.triton_kernels import TRITON_KERNELS_ENABLED

    return TRITON_KERNELS_ENABLED and torch.device(device).type == "cuda"


def packed_result(vo: VerifyOutput) -> torch.Tensor:
    """[bs, 1 + max_d + 1] int64: num_accepted, then output_ids (what the worker reads back)."""
    return torch.cat([vo.num_accepted.view(-1, 1), vo.output_ids], dim=1)


def verify_greedy_rows(
    predict: torch.Tensor,
    verify_ids: torch.Tensor,
    target_rows: torch.Tensor,
    draft_rows: torch.Tensor,
    valid: torch.Tensor,
    width: int,
) -> VerifyOutput:
    """verify_greedy with the ragged layout's indices built on the host (greedy_rows): a few
    device ops and no host synchronisation (what the engine runs every greedy verify step).

    Args:
        predict: [sum (d_i + 1)] int64 target argmax ids of the verify rows.
        verify_ids: [sum (d_i + 1)] int64 verify input (request i: its last token, then its
            d_i drafts).
        target_rows, draft_rows, valid: greedy_rows' lists as [bs * width] int64 tensors on
            predict's device.
        width: max d_i + 1.
    Returns:
        VerifyOutput, equal to verify_greedy's.
    """
    bs = target_rows.numel() // width
    target = predict[target_rows].view(bs, width)  # [bs, W] int64
    draft = verify_ids[draft_rows].view(bs, width)  # [bs, W] int64
    # x_j survives iff it equals the target argmax at j and every earlier draft survived.
    match = (target == draft) & (valid.view(bs, width) > 0)
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [bs] int64
    cols = torch.arange(width, device=predict.device).view(1, -1)
    # The output is the target's argmax prefix of length num_accepted + 1 (the bonus last).
    return VerifyOutput(target.masked_fill(cols > num_accepted.view(-1, 1), -1), num_accepted)


# -------------------------------------------------------------------------- batched sampling
def speculative_sample(
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    uniforms: torch.Tensor,
    sample_fn: BatchSampleFn,
    host_lens: list[int] | None = None,
) -> VerifyOutput:
    """Speculative sampling of a ragged batch (batched `speculative_sample_reference`).

    Same rule (Leviathan et al. 2023, Algorithm 1): accept x_j while u_j < p_j(x_j) / q_j(x_j)
    (q_j(x_j) = 0: accept iff p_j(x_j) > 0); at the first rejection draw from
    norm(max(p_j - q_j, 0)) (all zero: norm(p_j)); if every draft is accepted draw the bonus
    from p_{d_i} as given. sample_fn is called once, for all requests together.

    Args:
        draft_tokens: [sum d_i] int64, x ~ q.
        draft_lens: [bs] int, d_i >= 0.
        q: [sum d_i, V] float draft probs.
        p: [sum (d_i + 1), V] float processed target probs (rows sum to 1).
        uniforms: [sum (d_i + 1)] float in (0, 1), aligned with p (bonus rows unused).
        sample_fn: (probs [bs, V] float32, steps [bs] int64) -> [bs] int64; steps[i] is
            num_accepted_i, the index of the drawn token within request i's output this step.
        host_lens: optional, draft_lens as a host list: the call then never waits for the
            device (without it, the lengths are read back once).
    Returns:
        VerifyOutput (see the module docstring for the layout).
    Raises:
        ValueError: on inconsistent row counts or negative lengths.
    """
    lay = _layout(draft_lens, draft_tokens.numel(), p.shape[0], host_lens)
    if q.shape[0] != draft_tokens.numel() or uniforms.shape[0] != p.shape[0]:
        raise ValueError(f"q rows {q.shape[0]}, uniforms {uniforms.shape[0]} do not match")
    p, q, uniforms = p.float(), q.float(), uniforms.float()
    width = lay.max_d + 1
    draft = _gather_padded(draft_tokens.long(), lay.draft_starts, lay.lens, width, -1)
    cols = torch.arange(width, device=p.device).view(1, -1)  # [1, max_d + 1]
    valid = cols < lay.lens.view(-1, 1)  # [bs, max_d + 1] real draft positions

    # Accept tests at every draft position at once.
    t_rows = torch.where(valid, lay.target_starts.view(-1, 1) + cols, 0)  # [bs, max_d + 1]
    d_rows = torch.where(valid, lay.draft_starts.view(-1, 1) + cols, 0)  # [bs, max_d + 1]
    x = draft.clamp(min=0)  # [bs, max_d + 1] int64
    p_x = p[t_rows, x]  # [bs, max_d + 1] float32
    q_x = q[d_rows, x] if q.shape[0] > 0 else torch.zeros_like(p_x)
    # Accept with prob min(1, p/q): u < p/q; guard q(x) = 0: accept iff p(x) > 0.
    accept = torch.where(q_x > 0, uniforms[t_rows] < p_x / q_x, p_x > 0) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [bs] int64

    # One draw per request: residual at the first rejection, or the bonus row of p.
    rejected = (num_accepted < lay.lens).view(-1, 1)  # [bs, 1]
    p_sel = p[lay.target_starts + num_accepted]  # [bs, V]
    if q.shape[0] > 0:
        q_rows = (lay.draft_starts + num_accepted).clamp(max=q.shape[0] - 1)  # [bs]
        residual = torch.clamp(p_sel - q[q_rows], min=0.0)  # [bs, V]
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_sel)
        residual = residual / residual.sum(-1, keepdim=True)
        probs = torch.where(rejected, residual, p_sel)  # [bs, V] float32
    else:
        probs = p_sel
    new_ids = sample_fn(probs, num_accepted).long()  # [bs] int64

    output_ids = draft.masked_fill(cols >= num_accepted.view(-1, 1), -1)  # [bs, max_d + 1]
    output_ids.scatter_(1, num_accepted.view(-1, 1), new_ids.view(-1, 1))
    return VerifyOutput(output_ids, num_accepted)
