"""Attention backends, chosen by name through one registry."""

from __future__ import annotations

from collections.abc import Callable

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


def _torch_native(runner) -> AttentionBackend:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(runner)


def _triton(runner) -> AttentionBackend:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "--attention-backend triton needs the `triton` package (pip install triton)"
        ) from e
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(runner)


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch_native": _torch_native,
    "triton": _triton,
}


def create_attention_backend(name: str | None, model_runner) -> AttentionBackend:
    """Build the backend named by --attention-backend (default torch_native).

    Raises ValueError for a name that is not registered in this build.
    """
    name = name or "torch_native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend {name!r} is not available in this build; "
            f"choose one of {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name](model_runner)
