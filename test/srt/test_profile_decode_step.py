"""benchmark/profile_decode_step.py's argument checks: without CUDA, or with a --draft-path
that does not exist, it stops at once with a usage error (no traceback, no mode run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "profile_decode_step.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's message")
def test_without_cuda_a_usage_error():
    r = _run("--modes", "overlap", "adaptive", "--ttft-rounds", "8", "--batch-size", "32")
    assert r.returncode == 2, r.stderr
    assert "needs a CUDA device" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_draft_path_a_usage_error(tmp_path):
    missing = str(tmp_path / "no_draft")
    r = _run("--device", "cpu", "--modes", "overlap", "adaptive", "--draft-path", missing)
    assert r.returncode == 2, r.stderr
    assert f"--draft-path {missing}" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr
