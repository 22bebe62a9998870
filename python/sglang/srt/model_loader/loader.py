"""Model loading: resolve --model-path to an HF directory, build the model, fill its weights."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.rotary_embedding import rope_sharing
from sglang.srt.model_loader.bundled import bundled_gguf_path
from sglang.srt.model_loader.gguf_convert import convert_gguf_to_hf
from sglang.srt.model_loader.weight_utils import (
    checkpoint_weights_iterator,
    initialize_dummy_weights,
)
from sglang.srt.models.registry import ModelRegistry

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def resolve_model_path(model_path: str | None) -> str:
    """Local HF directory to serve for --model-path.

    None -> the bundled SmolLM2-135M-Instruct GGUF, converted; a .gguf file -> its converted
    directory (cached, see gguf_convert); a directory -> itself.

    Raises:
        ValueError: the path is neither an existing directory nor an existing .gguf file.
        FileNotFoundError: None was given and the bundled model package is missing.
    """
    if model_path is None:
        return convert_gguf_to_hf(bundled_gguf_path())
    if os.path.isdir(model_path):
        return model_path
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return convert_gguf_to_hf(model_path)
    raise ValueError(
        f"model path '{model_path}' does not exist or is not a model: expected a local Hugging "
        "Face model directory or a .gguf file (hub downloads are not supported)"
    )


@contextlib.contextmanager
def default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create tensors in `dtype` inside the block (the model's parameters), then restore."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model_config: ModelConfig,
    load_format: str = "auto",
    device: str = "cpu",
    random_seed: int | None = None,
) -> nn.Module:
    """Build the model for model_config.architecture on `device` in model_config.dtype.

    load_format 'auto' / 'safetensors' stream the checkpoint's tensors; 'dummy' draws
    normal(0, 0.02) weights (norm weights 1) seeded with `random_seed` (default 0).
    Returns the model in eval mode with requires_grad off.

    Raises:
        ValueError: unknown load_format, or the checkpoint lacks weights for some parameters.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load_format '{load_format}'; choose from {LOAD_FORMATS}")
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture)
    start = time.perf_counter()
    with default_torch_dtype(model_config.dtype), torch.device(device), rope_sharing():
        model = model_cls(model_config.hf_config)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed=0 if random_seed is None else random_seed)
    else:
        _load_checkpoint(model, model_config.model_path)
    if hasattr(model, "post_load_weights"):
        model.post_load_weights()
    model.eval().requires_grad_(False)
    logger.info(
        "Loaded %s (%s, %s) in %.1f s",
        model_config.architecture,
        load_format,
        model_config.dtype,
        time.perf_counter() - start,
    )
    return model


def _load_checkpoint(model: nn.Module, model_dir: str) -> None:
    loaded = model.load_weights(checkpoint_weights_iterator(model_dir))
    if loaded is None:
        return
    missing = sorted(set(dict(model.named_parameters())) - set(loaded))
    if missing:
        raise ValueError(
            f"Checkpoint '{model_dir}' has no weights for {len(missing)} parameter(s): "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
