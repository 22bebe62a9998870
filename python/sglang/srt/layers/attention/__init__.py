"""Attention backends, chosen by name through one registry."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


def check_backend_device(name: str, device: str | torch.device | None) -> None:
    """Raise ValueError when backend `name` cannot run on `device` (None: unknown): flashinfer
    needs CUDA; triton needs CUDA, or a CPU under the Triton interpreter (TRITON_INTERPRET=1,
    slow: for tests); torch_native runs anywhere. Called when flags are resolved (before the
    model loads) and when a backend is built."""
    if name == "torch_native" or (device is not None and torch.device(device).type == "cuda"):
        return
    if name == "flashinfer":
        raise ValueError(
            f"--attention-backend flashinfer needs a CUDA device (got {device}); "
            "use --attention-backend torch_native on CPU (the default there)"
        )
    if name == "triton" and device is not None and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton needs a CUDA device; on CPU it runs only under the "
            "Triton interpreter (set TRITON_INTERPRET=1, slow: for tests); use "
            "--attention-backend torch_native on CPU"
        )


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


def _flashinfer(runner) -> AttentionBackend:
    check_backend_device("flashinfer", getattr(runner, "device", None))
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA library the wheel needs is missing
        raise ValueError(
            "--attention-backend flashinfer needs the flashinfer-python package, which failed "
            f"to import ({type(e).__name__}: {e}); install it or use --attention-backend triton"
        ) from e
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(runner)


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch_native": _torch_native,
    "triton": _triton,
    "flashinfer": _flashinfer,
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
