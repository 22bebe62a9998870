"""Rotary position embedding (RoFormer, Su et al. 2021), neox style (rotate halves), with the
default and Llama 3 ("llama3") frequency schedules, plus linear position interpolation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from sglang.srt.layers.triton_kernels import use_triton_kernels


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """[rotary_dim / 2] float32: base ** (-2i / rotary_dim)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 schedule (Meta's reference `apply_scaling`): wavelengths longer than
    original_max / low_freq_factor are divided by `factor`, shorter than original_max /
    high_freq_factor are kept, and the band between is interpolated smoothly."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_neox(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rotary_dim` channels of every head.

    cos_sin_cache: [max_position, rotary_dim] float32 buffer, [cos | sin] of position * inv_freq.
    forward(positions [T] int64, query [T, H * head_size], key [T, Hkv * head_size]) -> (q, k)
    with the input shapes and dtypes. Positions >= max_position raise IndexError.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
        inv_freq: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not is_neox_style:
            raise NotImplementedError("only neox-style (rotate-half) RoPE is implemented")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        if inv_freq is None:
            inv_freq = _default_inv_freq(rotary_dim, base)
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(torch.float32))  # [max_pos, rotary_dim / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, rotary_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _apply(self, fn, recurse=True):  # keep the cache in float32 across .to(dtype)
        super()._apply(fn, recurse)
        self.cos_sin_cache = self.cos_sin_cache.to(torch.float32)
        return self

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(x.shape[0], -1, self.head_size)  # [T, heads, head_size]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        rot = rot * cos + _rotate_neox(rot) * sin
        return torch.cat((rot, rest), dim=-1).reshape(shape)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton_kernels(query, key):  # in place on CUDA (positions are not range-checked)
            from sglang.srt.layers.triton_kernels.rotary import rotary_embedding_

            return rotary_embedding_(
                positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim
            )
        cos_sin = self.cos_sin_cache[positions]  # [T, rotary_dim] float32
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(query.dtype)  # [T, 1, rotary_dim]
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


# The RotaryEmbeddings shared within the model being built (rope_sharing), or None outside
# one: a module shared across models would follow whichever model's .to() ran last.
_ROPE_SCOPE: dict[tuple, RotaryEmbedding] | None = None


@contextlib.contextmanager
def rope_sharing() -> Iterator[None]:
    """Within this context get_rope returns one RotaryEmbedding per distinct setting, shared by
    every layer that asks (one cos/sin cache per model, e.g. 64 MiB for Llama-3.1-8B's 131072
    positions instead of 64 MiB per layer). model_loader.get_model and load_draft_model build
    each model inside its own context, so no two models share a module. Nests: an inner context
    starts its own table."""
    global _ROPE_SCOPE
    outer, _ROPE_SCOPE = _ROPE_SCOPE, {}
    try:
        yield
    finally:
        _ROPE_SCOPE = outer


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """A RotaryEmbedding for these settings: shared between the layers of the model being
    built inside rope_sharing(), a new module outside it.

    rope_scaling: None or an HF rope dict whose 'rope_type' (or legacy 'type') is 'default',
    'llama3' (needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    or 'linear' (needs factor). Raises ValueError for other types.
    """
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    key = (
        head_size,
        rotary_dim,
        max_position,
        base,
        rope_type,
        tuple(sorted((k, str(v)) for k, v in scaling.items())),
        is_neox_style,
        str(torch.get_default_device()),
        dtype,
    )
    if _ROPE_SCOPE is not None and key in _ROPE_SCOPE:
        return _ROPE_SCOPE[key]
    inv_freq = _default_inv_freq(rotary_dim, base)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type != "default":
        raise ValueError(
            f"rope type '{rope_type}' is not supported (supported: default, llama3, linear)"
        )
    rope = RotaryEmbedding(
        head_size, rotary_dim, max_position, base, is_neox_style, dtype, inv_freq=inv_freq
    )
    if _ROPE_SCOPE is not None:
        _ROPE_SCOPE[key] = rope
    return rope


def rope_params_from_config(config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from an HF config, reading both the transformers 5
    `rope_parameters` dict and the older `rope_theta` / `rope_scaling` attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params:
        params = dict(legacy)
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if rope_type != "default" else None)
