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


@pytest.fixture(scope="session")
def draft_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A random EAGLE-3 draft for tiny_model_dir (make_tiny_eagle3_dir's defaults: no draft
    vocabulary, seed 0), shared by the speculative tests that only read it."""
    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

    return make_tiny_eagle3_dir(str(tmp_path_factory.mktemp("eagle3")), tiny_model_dir)


LIMITS_API_KEY = "sk-test-key"


@pytest.fixture(scope="session")
def limits_server(tiny_model_dir):
    """The tiny Llama served with small limits, shared by test_http_errors.py and
    test_http_limits.py (one server for both): API key LIMITS_API_KEY, 2 running and 4 queued
    requests, and a KV cache of 2048 tokens, the model's context length, so that the KV cache
    is the tighter limit on prompts (longest prompt 2046 tokens, not 2047)."""
    from test_http_server import ServerProcess

    srv = ServerProcess(
        tiny_model_dir,
        "--max-queued-requests",
        "4",
        "--max-running-requests",
        "2",
        "--max-total-tokens",
        "2048",
        api_key=LIMITS_API_KEY,
    )
    yield srv
    srv.stop()
