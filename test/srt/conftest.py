from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random-weight Llama with the bundled SmolLM2 tokenizer."""
    from sglang.test.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))
