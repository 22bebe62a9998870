"""Fused counter-based sampling: ``argmax(p / -log(u))`` in one pass over each row.

Computes exactly what ``sglang.srt.sampling.random.sample_from_probs`` computes (same splitmix64
noise bits, same float32 ``u``, ``E = -log(u)``, ``score = p / E``, first maximum wins) without
materialising the [bs, V] int64 / float32 noise tensors. Each program walks its columns in
blocks, keeping a per-lane running best (strict ``>``, so the earliest column of a lane wins),
then reduces the lanes to (max score, lowest index among the maxima). For small batches with a
large vocabulary a row is split over several programs and a second tiny kernel reduces the
per-chunk winners (chunks are ordered, so the lowest index among equal maxima is still first).

The integer arithmetic is exact in int64 (wrapping multiply; logical right shifts emulated by an
arithmetic shift and a mask, as random.py does), so ``u`` is bit-identical to ``uniform_noise``.
On CUDA the log is libdevice's ``logf`` and the division is IEEE round-to-nearest (``div_rn``),
the same functions torch's CUDA kernels use; under TRITON_INTERPRET (CPU) they are numpy's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang.srt.sampling.random import _M1, _M2, GOLDEN, K_POS, K_STREAM, _signed

try:  # precise logf on the compiled path; the interpreter has no extern functions
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None

_C_M1 = tl.constexpr(_M1)
_C_M2 = tl.constexpr(_M2)
_C_GOLDEN = tl.constexpr(GOLDEN)
_C_K_POS = tl.constexpr(K_POS)
# Masks that turn an arithmetic right shift by k into a logical one: (1 << (64 - k)) - 1.
_C_MASK27 = tl.constexpr((1 << 37) - 1)
_C_MASK30 = tl.constexpr((1 << 34) - 1)
_C_MASK31 = tl.constexpr((1 << 33) - 1)
_C_MASK40 = tl.constexpr((1 << 24) - 1)

_BLOCK = 1024
_MIN_SPLIT_COLS = 2048  # fewest columns per program when a row is split across programs
# Smallest SPLITS of the reduction: the default split count follows the batch size (up to
# cdiv(V, _MIN_SPLIT_COLS), 63 for a 128k vocabulary), and one power of two per count would
# compile a new reduction kernel for each while serving; masked lanes cost nothing.
_REDUCE_SPLITS = 64
_SM_COUNT: dict[int, int] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _mix64(x):
    """splitmix64 finaliser on int64 (wrapping multiply, logical shifts via masks)."""
    x = (x ^ ((x >> 30) & _C_MASK30)) * _C_M1
    x = (x ^ ((x >> 27) & _C_MASK27)) * _C_M2
    return x ^ ((x >> 31) & _C_MASK31)


@triton.jit
def _row_key(seeds_ptr, positions_ptr, row, ROW_ADD: tl.constexpr):
    """key = mix64(seed ^ mix64(position * K_POS + ROW_ADD)), an int64 scalar."""
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    return _mix64(seed ^ _mix64(pos * _C_K_POS + ROW_ADD))


@triton.jit
def _uniform(key, cols):
    """u in (0, 1) for int64 0-based columns `cols` of the row with `key` (float32)."""
    x = _mix64(key + (cols + 1) * _C_GOLDEN)
    top23 = (x >> 41) & (_C_MASK40 >> 1)  # [0, 2**23): u <= 1 - 2**-24 < 1 (random.py)
    return (top23.to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23, exact


@triton.jit(  # package docstring: variants (chunk_cols, num_splits follow bs)
    do_not_specialize=["chunk_cols", "num_splits"],
    do_not_specialize_on_alignment=["seeds_ptr", "positions_ptr"],
)
def _sample_kernel(
    probs_ptr,
    seeds_ptr,
    positions_ptr,
    part_val_ptr,
    part_idx_ptr,
    probs_stride,
    num_cols,
    chunk_cols,
    num_splits,
    ROW_ADD: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    key = _row_key(seeds_ptr, positions_ptr, row, ROW_ADD)
    col_begin = split * chunk_cols
    col_end = tl.minimum(col_begin + chunk_cols, num_cols)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int64)
    row_ptr = probs_ptr + row * probs_stride
    for offset in tl.range(0, chunk_cols, BLOCK):  # chunk_cols is a multiple of BLOCK
        cols = col_begin + offset + lanes  # [BLOCK] int64
        mask = cols < col_end
        p = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        u = _uniform(key, cols)
        if PRECISE_LOG:
            e = -libdevice.log(u)
        else:
            e = -tl.log(u)
        score = tl.math.div_rn(p, e)
        score = tl.where(mask, score, float("-inf"))
        better = score > best_val  # strict: a lane keeps its earliest maximum
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    # Lanes that saw no column hold (-inf, 0), so a chunk of all -inf scores reports index 0,
    # the first maximum, as torch.argmax does.
    first = tl.min(tl.where(best_val == top, best_idx, num_cols), axis=0)
    tl.store(part_val_ptr + row * num_splits + split, top)
    tl.store(part_idx_ptr + row * num_splits + split, first)


@triton.jit(do_not_specialize=["num_splits"])  # package docstring: variants
def _reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_splits, BIG, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS)
    mask = offs < num_splits
    vals = tl.load(part_val_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_splits + offs, mask=mask, other=0)
    top = tl.max(vals, axis=0)
    first = tl.min(tl.where(mask & (vals == top), idx, BIG), axis=0)
    tl.store(out_ptr + row, first)


@triton.jit(do_not_specialize_on_alignment=["seeds_ptr", "positions_ptr"])  # as _sample_kernel
def _uniform_kernel(
    seeds_ptr,
    positions_ptr,
    out_ptr,
    out_stride,
    num_cols,
    ROW_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    key = _row_key(seeds_ptr, positions_ptr, row, ROW_ADD)
    tl.store(out_ptr + row * out_stride + cols, _uniform(key, cols), mask=cols < num_cols)


def _row_add(stream: int) -> int:
    """The per-stream constant of random.py: int64 bits of stream * K_STREAM + 1."""
    return _signed(int(stream) * K_STREAM + 1)


def _check_rows(seeds: torch.Tensor, positions: torch.Tensor, bs: int) -> None:
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.dtype != torch.int64 or t.shape != (bs,):
            raise ValueError(f"{name} must be [{bs}] int64, got {tuple(t.shape)} {t.dtype}")


def _default_splits(bs: int, num_cols: int, device: torch.device) -> int:
    """Split rows across programs only when the batch alone cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = triton.cdiv(2 * _SM_COUNT[index], bs)
    return max(1, min(want, triton.cdiv(num_cols, _MIN_SPLIT_COLS)))


def sample_from_probs_fused(
    probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int = 0,
    *,
    num_splits: int | None = None,
    block: int = _BLOCK,
) -> torch.Tensor:
    """One id per row of `probs`, equal to ``random.sample_from_probs`` (exponential race).

    Args:
        probs: [bs, V] floating (read as float32), rows >= 0, need not be normalised.
        seeds: [bs] int64 per-row seeds; positions: [bs] int64 output positions.
        stream: the noise stream (random.STREAM_*).
        num_splits: programs per row (None: 1 on CPU, enough to fill the GPU on CUDA).
        block: columns per program step (a power of two).
    Returns:
        [bs] int64 on probs.device; an all-zero row gives 0 (torch.argmax's first maximum).
        NaN scores are skipped (torch.argmax would return the first NaN).
    Raises:
        ValueError on shape/dtype mismatch or V == 0.
    """
    if probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(
            f"probs must be a 2-D float tensor, got {tuple(probs.shape)} {probs.dtype}"
        )
    bs, num_cols = probs.shape
    if num_cols == 0:
        raise ValueError("probs has no columns")
    _check_rows(seeds, positions, bs)
    out = torch.empty(bs, dtype=torch.int64, device=probs.device)
    if bs == 0:
        return out
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    seeds, positions = seeds.contiguous(), positions.contiguous()
    splits = num_splits or _default_splits(bs, num_cols, probs.device)
    chunk = triton.cdiv(triton.cdiv(num_cols, splits), block) * block
    splits = triton.cdiv(num_cols, chunk)  # no empty chunks
    part_val = torch.empty((bs, splits), dtype=torch.float32, device=probs.device)
    part_idx = out.view(bs, 1) if splits == 1 else torch.empty_like(part_val, dtype=torch.int64)
    precise = libdevice is not None and not _interpreting()
    _sample_kernel[(bs, splits)](
        probs,
        seeds,
        positions,
        part_val,
        part_idx,
        probs.stride(0),
        num_cols,
        chunk,
        splits,
        ROW_ADD=_row_add(stream),
        PRECISE_LOG=precise,
        BLOCK=block,
        num_warps=4,
    )
    if splits > 1:
        _reduce_kernel[(bs,)](
            part_val,
            part_idx,
            out,
            splits,
            num_cols,
            SPLITS=max(_REDUCE_SPLITS, triton.next_power_of_2(splits)),
        )
    return out


def uniform_noise_fused(
    seeds: torch.Tensor, positions: torch.Tensor, num_cols: int, stream: int = 0
) -> torch.Tensor:
    """The kernel's uniforms written out: [bs, V] float32, equal to ``random.uniform_noise``.

    For tests and debugging only (sampling never materialises them). Raises ValueError on
    shape/dtype mismatch.
    """
    bs = seeds.shape[0] if seeds.dim() == 1 else -1
    _check_rows(seeds, positions, bs)
    out = torch.empty((bs, num_cols), dtype=torch.float32, device=seeds.device)
    if bs > 0 and num_cols > 0:
        grid = (bs, triton.cdiv(num_cols, _BLOCK))
        _uniform_kernel[grid](
            seeds.contiguous(),
            positions.contiguous(),
            out,
            out.stride(0),
            num_cols,
            ROW_ADD=_row_add(stream),
            BLOCK=_BLOCK,
        )
    return out
