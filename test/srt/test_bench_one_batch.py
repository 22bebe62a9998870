"""sglang.bench_one_batch: its token counts (a speculative step commits several tokens) and its
refusals of bad sizes (a new-user helper, thirty-fourth session: --input-len 0 hung,
--batch-size 0 and an input past the context raised ZeroDivisionError, and decode_tok_s counted
verify steps instead of tokens)."""

from __future__ import annotations

import os

import pytest

import sglang
from sglang.bench_one_batch import main
from sglang.test.cli_checks import assert_usage_error

DRAFT = os.path.join(os.path.dirname(sglang.__file__), "data", "smollm2_eagle3")


def _run(*extra: str) -> dict:
    rows = main(
        ["--batch-size", "2", "--input-len", "16", "--output-len", "9", "--skip-hf", *extra]
    )
    assert len(rows) == 1
    return rows[0]["sglang"]


def test_plain_decode_counts_one_token_per_step(tiny_model_dir):
    r = _run("--model-path", tiny_model_dir)
    assert r["decode_steps"] == 8
    assert r["decode_tok_s"] == pytest.approx(2 * 8 / r["decode_s"])


def test_speculative_decode_counts_tokens_not_steps():
    """The bundled SmolLM2 and its trained draft accept drafts even on random prompt ids, so
    the 8 decode tokens of each request take fewer verify steps."""
    r = _run("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", DRAFT)
    assert 1 <= r["decode_steps"] < 8
    assert r["decode_tok_s"] == pytest.approx(2 * 8 / r["decode_s"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--input-len", "0"], "--input-len must be >= 1"),
        (["--output-len", "-1"], "--output-len must be >= 0"),
        (["--input-len", "100000"], "exceeds the model's context length"),
        (["--result-file", "/nonexistent/dir/x.json"], "does not exist"),
    ],
)
def test_bad_sizes_are_refused(tiny_model_dir, capsys, args, message):
    assert_usage_error(main, ["--model-path", tiny_model_dir, "--skip-hf", *args], message, capsys)
