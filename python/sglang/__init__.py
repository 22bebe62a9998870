"""SGLang-compatible serving engine with per-request adaptive speculative decoding."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import sglang` stays cheap; `sglang.Engine` imports torch and the runtime.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
