from __future__ import annotations

import os

import pytest

# Before pytest collects any test module (so before triton is imported anywhere): without CUDA
# the Triton kernel tests run through Triton's interpreter, which TRITON_INTERPRET=1 selects.
import sglang.test.triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET)

# Every engine a test starts takes this many KV slots unless it asks otherwise, so that many
# engines (in-process schedulers included) can share one GPU when the suite runs on CUDA.
os.environ.setdefault("SGLANG_MAX_TOTAL_TOKENS_DEFAULT", "65536")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random-weight Llama with the bundled SmolLM2 tokenizer."""
    from sglang.test.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))
