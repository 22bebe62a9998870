"""Deterministic, counter-based per-request randomness for sampling.

Each sampled token draws its noise from a pure function of (seed, position, column, stream):

    key   = mix64(seed ^ mix64(position * K_POS + stream * K_STREAM + 1))   # per row
    x     = mix64(key + (column + 1) * GOLDEN)                              # per element
    u     = ((x >>> 41) + 0.5) / 2**23                                      # in (0, 1)

where mix64 is the splitmix64 finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014). Everything up to `u` is exact int64 arithmetic (wrapping
multiplication, logical shifts emulated with a mask), so CPU and CUDA produce bit-identical
uniforms, and a request's samples depend only on its seed and output position, never on the
batch it is in or its row.

Sampling uses the exponential race (equivalent to Gumbel-max): with E_i = -log(u_i) ~ Exp(1),
argmax_i p_i / E_i is distributed as Categorical(p). See `sample_from_probs`.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
GOLDEN = _signed(0x9E3779B97F4A7C15)
K_POS = _signed(0xD1B54A32D192ED03)
K_STREAM = _signed(0x8CB92BA72F3D8DD7)

# Streams used by the engine (keep distinct so different draws are independent).
STREAM_SAMPLE = 0
STREAM_SPEC_ACCEPT = 1
STREAM_SPEC_RESAMPLE = 2
STREAM_DRAFT = 3  # draft tokens of speculative decoding (chain drafting)


def to_int64_seed(seed: int) -> int:
    """Map any Python int to the int64 with the same low 64 bits (for seeds tensors)."""
    return _signed(seed)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic). Same shape and dtype."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_noise(
    seeds: torch.Tensor, positions: torch.Tensor, num_cols: int, stream: int = 0
) -> torch.Tensor:
    """Counter-based uniforms.

    Args:
        seeds: [bs] int64, one seed per row.
        positions: [bs] int64, the output index of the token being drawn.
        num_cols: V, the number of columns (usually the vocab size).
        stream: small int separating independent draws for the same (seed, position).
    Returns:
        [bs, V] float32 strictly inside (0, 1), multiples of 2**-24 plus 2**-25; identical on
        every device for identical inputs.
    """
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64
    row = positions * K_POS + _signed(stream * K_STREAM + 1)  # [bs] int64
    key = mix64(seeds ^ mix64(row))  # [bs] int64
    cols = torch.arange(1, num_cols + 1, dtype=torch.int64, device=seeds.device) * GOLDEN  # [V]
    x = mix64(key[:, None] + cols[None, :])  # [bs, V] int64
    # 23 bits: (2**23 - 0.5) / 2**23 = 1 - 2**-24 is exact in float32, so u < 1 strictly (24
    # bits rounded (2**24 - 0.5) / 2**24 to 1.0: exponential noise 0, a zero-probability
    # token could win the race).
    top23 = _shr(x, 41)  # [bs, V] int64 in [0, 2**23)
    return (top23.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, num_cols: int, stream: int = 0
) -> torch.Tensor:
    """[bs, V] float32 Exp(1) samples, -log(u) of `uniform_noise` (always > 0)."""
    return -torch.log(uniform_noise(seeds, positions, num_cols, stream))


def sample_from_probs(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """Draw one id per row from `probs` [bs, V] (rows need not be normalised, >= 0).

    Exponential race: argmax(p / E), E ~ Exp(1) i.i.d. (the Gumbel-max trick in another form:
    P(i wins) = p_i / sum(p)). Zero-probability ids never win unless the whole row is zero.
    Returns [bs] int64. On CUDA with the Triton kernels enabled this runs as one fused kernel
    (layers/triton_kernels/sampling.py) computing the same noise without materialising it;
    `_sample_from_probs_torch` is the reference path.
    """
    if _fused_applies(probs, seeds, positions):
        from sglang.srt.layers.triton_kernels.sampling import sample_from_probs_fused

        return sample_from_probs_fused(probs, seeds, positions, stream)
    return _sample_from_probs_torch(probs, seeds, positions, stream)


def _fused_applies(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> bool:
    """The fused kernel handles plain [bs, V] float rows with [bs] int64 seeds/positions."""
    from sglang.srt.layers.triton_kernels import use_triton_kernels

    if not use_triton_kernels(probs) or probs.dim() != 2 or not probs.is_floating_point():
        return False
    bs, num_cols = probs.shape
    return (
        num_cols > 0
        and seeds.dtype == torch.int64
        and positions.dtype == torch.int64
        and seeds.shape == (bs,)
        and positions.shape == (bs,)
        and seeds.device == probs.device == positions.device
    )


def _sample_from_probs_torch(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """The PyTorch path of `sample_from_probs` (materialises the [bs, V] noise), any device."""
    exp = exponential_noise(seeds, positions, probs.shape[-1], stream)  # [bs, V] float32
    return torch.argmax(probs.float() / exp, dim=-1)
