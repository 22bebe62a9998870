"""ModelConfig: what the engine needs to know about a checkpoint, read from an HF directory."""

from __future__ import annotations

import json
import logging
import os

import torch
from transformers import AutoConfig, PretrainedConfig

from sglang.srt.models.registry import ModelRegistry

logger = logging.getLogger(__name__)

_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
# Upstream's escape hatch for --context-length beyond the model's max_position_embeddings.
_ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


class ModelConfig:
    """Model facts for the engine.

    Args:
        model_path: a resolved local HF directory (see model_loader.resolve_model_path).
        context_length: max tokens per request; default max_position_embeddings.
        dtype: 'auto' | 'half' | 'float16' | 'bfloat16' | 'float' | 'float32'.
        device: 'cpu' | 'cuda' | 'auto' (only used to choose the 'auto' dtype).

    Raises:
        ValueError: no config.json, unsupported architecture, unknown dtype, context_length above
            max_position_embeddings (unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, as
            upstream), or a sliding window shorter than the context (not implemented).
    """

    def __init__(
        self,
        model_path: str,
        context_length: int | None = None,
        dtype: str = "auto",
        device: str = "cpu",
    ) -> None:
        self.model_path = model_path
        self.hf_config = self._init_hf_config(model_path)
        self._init_architecture()
        self._init_shapes()
        self._init_context_len(context_length)
        self._check_sliding_window()
        self.dtype = self._init_dtype(dtype, device)
        self.eos_token_ids = self._init_eos_token_ids()

    @staticmethod
    def _init_hf_config(model_path: str) -> PretrainedConfig:
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(
                f"'{model_path}' is not a Hugging Face model directory: it has no config.json"
            )
        return AutoConfig.from_pretrained(model_path)

    def _init_architecture(self) -> None:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json in '{self.model_path}' has no 'architectures' entry")
        _, self.architecture = ModelRegistry.resolve_model_cls(archs)
        self.hf_architectures = list(archs)

    def _init_shapes(self) -> None:
        cfg = self.hf_config
        self.hidden_size: int = cfg.hidden_size
        self.num_hidden_layers: int = cfg.num_hidden_layers
        self.num_attention_heads: int = cfg.num_attention_heads
        self.num_key_value_heads: int = (
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        )
        self.head_dim: int = getattr(cfg, "head_dim", None) or (
            cfg.hidden_size // cfg.num_attention_heads
        )
        self.vocab_size: int = cfg.vocab_size
        self.tie_word_embeddings: bool = bool(getattr(cfg, "tie_word_embeddings", False))
        self.max_position_embeddings: int = getattr(cfg, "max_position_embeddings", 2048)

    def _init_context_len(self, context_length: int | None) -> None:
        derived = self.max_position_embeddings
        if context_length is None:
            self.context_len = derived
            return
        if context_length > derived:
            msg = (
                f"User-specified context_length ({context_length}) is greater than the model's "
                f"max_position_embeddings ({derived}); this may give wrong outputs or errors."
            )
            if os.environ.get(_ALLOW_LONGER_CONTEXT_ENV, "").lower() in ("1", "true", "yes"):
                logger.warning(msg)
            else:
                raise ValueError(f"{msg} To allow it anyway, set {_ALLOW_LONGER_CONTEXT_ENV}=1.")
        self.context_len = context_length

    def _check_sliding_window(self) -> None:
        cfg = self.hf_config
        window = getattr(cfg, "sliding_window", None)
        if window is None or getattr(cfg, "use_sliding_window", True) is False:
            return
        if window < self.context_len:
            raise ValueError(
                f"{self.architecture} uses sliding-window attention (window {window}) shorter "
                f"than the context length {self.context_len}; sliding windows are not supported. "
                f"Pass --context-length {window} (or less) to run it with full attention."
            )
        logger.warning(
            "sliding_window=%d >= context length %d: running full attention",
            window,
            self.context_len,
        )

    def _init_dtype(self, dtype: str, device: str) -> torch.dtype:
        if dtype != "auto":
            if dtype not in _DTYPES:
                raise ValueError(f"Unknown dtype '{dtype}'; choose from auto, {', '.join(_DTYPES)}")
            return _DTYPES[dtype]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not str(device).startswith("cuda"):
            return torch.float32
        config_dtype = getattr(self.hf_config, "dtype", None)  # transformers 5 name
        if config_dtype in (torch.float16, "float16"):
            return torch.float16
        return torch.bfloat16

    def _init_eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        _add_ids(ids, getattr(self.hf_config, "eos_token_id", None))
        gen_path = os.path.join(self.model_path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                _add_ids(ids, json.load(f).get("eos_token_id"))
        return ids

    def get_num_kv_heads(self, tensor_parallel_size: int) -> int:
        """KV heads held by one tensor-parallel rank (at least 1: heads are replicated)."""
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def __repr__(self) -> str:
        return (
            f"ModelConfig({self.architecture}, path={self.model_path!r}, layers="
            f"{self.num_hidden_layers}, hidden={self.hidden_size}, heads={self.num_attention_heads}"
            f"/{self.num_key_value_heads}, head_dim={self.head_dim}, vocab={self.vocab_size}, "
            f"context_len={self.context_len}, dtype={self.dtype})"
        )


def _add_ids(ids: set[int], value: int | list[int] | None) -> None:
    if value is None:
        return
    ids.update([value] if isinstance(value, int) else [int(v) for v in value])
