"""Architecture name (config.json "architectures") -> model class, imported lazily."""

from __future__ import annotations

import importlib
import importlib.util

from torch import nn

# architecture -> (module, class name). Modules are imported only when the class is needed.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("sglang.srt.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("sglang.srt.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
    # EAGLE-3 draft heads (module written separately; listed only once it exists)
    "LlamaForCausalLMEagle3": ("sglang.srt.models.llama_eagle3", "LlamaForCausalLMEagle3"),
    # EAGLE (v1/v2) draft heads
    "LlamaForCausalLMEagle": ("sglang.srt.models.llama_eagle", "LlamaForCausalLMEagle"),
}


class _ModelRegistry:
    """Upstream-style registry: get_supported_archs(), resolve_model_cls(architectures)."""

    def get_supported_archs(self) -> list[str]:
        """Architectures whose module is importable, in registration order."""
        return [a for a, (mod, _) in _MODELS.items() if _module_exists(mod)]

    def is_supported(self, architecture: str) -> bool:
        return architecture in self.get_supported_archs()

    def resolve_model_cls(self, architectures: str | list[str]) -> tuple[type[nn.Module], str]:
        """(model class, architecture) for the first supported name.

        Raises:
            ValueError: none of the names is supported; the message lists the supported ones.
        """
        names = [architectures] if isinstance(architectures, str) else list(architectures)
        for arch in names:
            if self.is_supported(arch):
                module_name, cls_name = _MODELS[arch]
                return getattr(importlib.import_module(module_name), cls_name), arch
        raise ValueError(
            f"Model architecture(s) {names} not supported. "
            f"Supported architectures: {self.get_supported_archs()}"
        )


def _module_exists(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


ModelRegistry = _ModelRegistry()
