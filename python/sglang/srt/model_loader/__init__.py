"""Model loading entry points: resolve_model_path (path / .gguf / bundled default) and
get_model (build + load weights)."""

from __future__ import annotations

from sglang.srt.model_loader.loader import get_model, resolve_model_path

__all__ = ["get_model", "resolve_model_path"]
