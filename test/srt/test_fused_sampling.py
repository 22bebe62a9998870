"""Fused Triton sampling kernel against the PyTorch exponential race of sampling/random.py.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported). The noise is bit-identical by
construction, so the sampled ids must equal `_sample_from_probs_torch` exactly (ties only on
exactly equal float scores, which random inputs do not produce; engineered ties are tested
separately).
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import HAS_CUDA, compiled_variants  # first: TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers import triton_kernels  # noqa: E402
from sglang.srt.layers.triton_kernels import sampling as fused  # noqa: E402
from sglang.srt.layers.triton_kernels.sampling import (  # noqa: E402
    sample_from_probs_fused,
    uniform_noise_fused,
)
from sglang.srt.sampling import random as srt_random  # noqa: E402
from sglang.srt.sampling.random import (  # noqa: E402
    _sample_from_probs_torch,
    to_int64_seed,
    uniform_noise,
)

DEVICE = "cpu"  # the interpreter path; the gpu-marked tests below use "cuda"


@pytest.fixture(autouse=True)
def _interpreter_tests_only_without_cuda(request):
    """The unmarked tests feed CPU tensors to the Triton interpreter; with CUDA present triton
    compiles for the GPU instead, and the gpu-marked test covers the kernel there."""
    if HAS_CUDA and request.node.get_closest_marker("gpu") is None:
        pytest.skip("Triton-interpreter test (CPU tensors); the gpu-marked test runs on CUDA")


def _rows(bs: int, gen: torch.Generator, device: str = DEVICE) -> tuple[torch.Tensor, ...]:
    """[bs] int64 seeds over the full int64 range and [bs] int64 positions."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (bs,), dtype=torch.int64, generator=gen)
    positions = torch.randint(0, 1 << 40, (bs,), dtype=torch.int64, generator=gen)
    return seeds.to(device), positions.to(device)


def _probs(bs: int, num_cols: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, V] float32: dense rows, rows with ~half zeros, a one-hot row and an all-zero row."""
    probs = torch.rand(bs, num_cols, generator=gen)
    probs[1] *= torch.rand(num_cols, generator=gen) < 0.5
    probs[2] = torch.softmax(torch.randn(num_cols, generator=gen) * 4, dim=-1)  # peaked
    probs[3] = 0.0
    probs[3, num_cols - 2] = 1.0  # one-hot (in the last, partial block)
    probs[4] = 0.0  # all zero -> index 0, as torch.argmax
    return probs


@pytest.mark.parametrize("num_cols", [1000, 1337])
def test_uniform_noise_is_bit_identical(num_cols: int) -> None:
    gen = torch.Generator().manual_seed(num_cols)
    seeds, positions = _rows(4, gen)
    seeds[0] = to_int64_seed(2**64 - 1)
    positions[1] = 0
    for stream in (0, 1, 3):
        got = uniform_noise_fused(seeds, positions, num_cols, stream)
        assert got.dtype == torch.float32 and got.shape == (4, num_cols)
        assert torch.equal(got, uniform_noise(seeds, positions, num_cols, stream))


@pytest.mark.parametrize(
    "num_cols,block,num_splits",
    [(1000, 1024, None), (1000, 128, 1), (777, 128, 1), (777, 128, 3), (1000, 256, 4)],
)
def test_fused_ids_equal_torch(num_cols: int, block: int, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(7 + num_cols + block)
    probs = _probs(5, num_cols, gen)
    for stream in (0, 2):
        seeds, positions = _rows(5, gen)
        want = _sample_from_probs_torch(probs, seeds, positions, stream)
        got = sample_from_probs_fused(
            probs, seeds, positions, stream, block=block, num_splits=num_splits
        )
        assert got.dtype == torch.int64 and got.device == probs.device
        assert got.tolist() == want.tolist()
        assert got[3].item() == num_cols - 2 and got[4].item() == 0
        assert probs[1, got[1]] > 0  # zero-probability ids never win


def test_fused_half_precision_and_strided_probs() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.rand(5, 1200, generator=gen)
    probs = wide[:, 100:1100]  # a row stride of 1200: a view, not contiguous
    seeds, positions = _rows(5, gen)
    want = _sample_from_probs_torch(probs, seeds, positions, 1)
    assert sample_from_probs_fused(probs, seeds, positions, 1, block=256).tolist() == want.tolist()
    for dtype in (torch.bfloat16, torch.float16):
        low = probs.to(dtype)
        want = _sample_from_probs_torch(low, seeds, positions, 3)
        got = sample_from_probs_fused(low, seeds, positions, 3, block=256, num_splits=2)
        assert got.tolist() == want.tolist()


def test_ties_pick_the_lowest_index() -> None:
    """Equal maximal scores (+inf here) resolve to the first column, as torch.argmax does:
    within one lane (cols 5 and 5 + block), across lanes and across split chunks."""
    num_cols, block = 700, 128
    probs = torch.rand(4, num_cols)
    probs[0, [5 + block, 5]] = float("inf")  # same lane, later block first in the list
    probs[1, [300, 40]] = float("inf")  # different lanes and blocks
    probs[2, [650, 260]] = float("inf")  # different split chunks (3 chunks of 256)
    probs[3] = float("-inf")  # every score -inf: torch.argmax gives 0
    seeds, positions = _rows(4, torch.Generator().manual_seed(1))
    want = _sample_from_probs_torch(probs, seeds, positions)
    assert want.tolist() == [5, 40, 260, 0]
    for splits in (1, 3):
        got = sample_from_probs_fused(probs, seeds, positions, block=block, num_splits=splits)
        assert got.tolist() == want.tolist()


def test_bad_inputs_raise() -> None:
    probs = torch.rand(2, 10)
    seeds = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError):
        sample_from_probs_fused(probs, seeds.int(), seeds)
    with pytest.raises(ValueError):
        sample_from_probs_fused(probs, seeds[:1], seeds)
    with pytest.raises(ValueError):
        sample_from_probs_fused(probs[0], seeds, seeds)
    assert sample_from_probs_fused(probs[:0], seeds[:0], seeds[:0]).shape == (0,)


def test_sample_from_probs_routes_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton switch on, sample_from_probs calls the fused kernel for [bs, V] rows
    (same ids as the torch path) and keeps the torch path for shapes it does not handle."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return sample_from_probs_fused(*args, **kwargs)

    gen = torch.Generator().manual_seed(11)
    probs = _probs(5, 300, gen)
    seeds, positions = _rows(5, gen)
    want = _sample_from_probs_torch(probs, seeds, positions, 2)
    assert srt_random.sample_from_probs(probs, seeds, positions, 2).tolist() == want.tolist()
    assert calls == []  # CPU: the switch is off

    monkeypatch.setattr(triton_kernels, "use_triton_kernels", lambda t, *more: True)
    monkeypatch.setattr(fused, "sample_from_probs_fused", spy)
    assert srt_random.sample_from_probs(probs, seeds, positions, 2).tolist() == want.tolist()
    assert calls == [(5, 300)]
    # One probability row shared by 5 seeds broadcasts in the torch path only.
    shared = srt_random.sample_from_probs(probs[:1], seeds, positions, 2)
    assert shared.tolist() == _sample_from_probs_torch(probs[:1], seeds, positions, 2).tolist()
    assert calls == [(5, 300)]


# ---------------------------------------------------------------------------------------------
# CUDA: the compiled kernel against torch's CUDA path at real vocabulary sizes.


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_cols", [49152, 128256])
def test_fused_equals_torch_on_cuda(num_cols: int) -> None:
    gen = torch.Generator().manual_seed(num_cols)
    seeds, positions = _rows(64, gen, "cuda")
    assert torch.equal(
        uniform_noise_fused(seeds, positions, num_cols, 2),
        uniform_noise(seeds, positions, num_cols, 2),
    )
    total = same = 0
    for bs in (1, 3, 16, 64):
        for dtype, temp in ((torch.float32, 1.0), (torch.bfloat16, 3.0), (torch.float32, 0.3)):
            logits = torch.randn(bs, num_cols, generator=gen).cuda() * temp
            probs = torch.softmax(logits, dim=-1).to(dtype)
            for step in range(4):
                pos = positions[:bs] + step
                want = _sample_from_probs_torch(probs, seeds[:bs], pos, step % 2)
                got = sample_from_probs_fused(probs, seeds[:bs], pos, step % 2)
                one_program = sample_from_probs_fused(
                    probs, seeds[:bs], pos, step % 2, num_splits=1
                )
                assert torch.equal(got, one_program)  # splitting never changes the winner
                total += bs
                same += int((got == want).sum())
    assert total == 4 * 3 * (1 + 3 + 16 + 64)
    # Measured on the H200: 3 of 1008 rows differ at V = 128256 (last-ulp float differences
    # between libdevice and torch's kernels decide near-ties); the noise itself is identical.
    assert same >= 0.995 * total, f"{total - same} of {total} rows differ"
    # The routed entry point uses the kernel on CUDA and agrees with it exactly.
    if triton_kernels.use_triton_kernels(probs):
        routed = srt_random.sample_from_probs(probs, seeds[:bs], pos, 1)
        assert torch.equal(routed, sample_from_probs_fused(probs, seeds[:bs], pos, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_batch_sizes_and_offset_rows_reuse_the_compiled_kernels() -> None:
    """The split count follows the batch size and the seed / position vectors may be views at
    any offset: after the first sampled batch, other batch sizes compile no new sampling or
    reduction kernel while serving (triton_kernels package docstring, "Variants")."""
    kernels = [fused._sample_kernel, fused._reduce_kernel]
    compiled_variants(*kernels)  # skips where Triton keeps no cache to inspect
    gen = torch.Generator().manual_seed(5)
    seeds, positions = _rows(301, gen, "cuda")
    counts = None
    for i, bs in enumerate([1, 3, 17, 100, 40, 7]):  # 264 / bs programs per row: 1 .. 24
        probs = torch.softmax(torch.randn(bs, 49152, generator=gen), dim=-1).cuda()
        off = i % 2  # views at element offset 1 every other batch
        sample_from_probs_fused(probs, seeds[off : off + bs], positions[off : off + bs])
        now = compiled_variants(*kernels)
        counts = counts or now  # other tests of this process may have compiled other variants
        assert now == counts
