"""benchmark/eagle3_accept_length.py on a tiny random target and draft (CPU): report keys,
accept-length bookkeeping from meta_info, and greedy equality with the non-speculative run."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from sglang.test.cli_checks import assert_usage_error
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_NEW = 12


def _bench_module():
    path = os.path.join(ROOT, "benchmark", "eagle3_accept_length.py")
    spec = importlib.util.spec_from_file_location("eagle3_accept_length", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench_module()


def test_prompt_files_are_complete(bench):
    assert len(bench.load_prompts(bench.DATA_DIR, "mtbench", None)) == 80
    assert len(bench.load_prompts(bench.DATA_DIR, "humaneval", None)) == 164
    with open(os.path.join(bench.DATA_DIR, "sharegpt_train_prompts.jsonl")) as f:
        assert sum(1 for _ in f) == 4000


def test_summarize_counts_mismatches(bench):
    meta = {"completion_tokens": 4}
    outs = [{"output_ids": [1, 2, 3, 4], "meta_info": meta}] * 3
    ref = [[1, 2, 3, 4], [1, 2, 9, 4], [1, 2, 3]]
    res = bench.summarize(outs, 2.0, ref)
    assert res["mismatches"] == 2
    assert res["mismatch_detail"] == [
        {"index": 1, "first_diff_token": 2},
        {"index": 2, "first_diff_token": 3},
    ]
    assert res["tokens_per_s"] == 6.0


def test_benchmark_main_tiny(bench, tiny_model_dir, tmp_path):
    draft = make_tiny_eagle3_dir(str(tmp_path / "draft"), tiny_model_dir)
    out = tmp_path / "res" / "eagle3_accept_length_tiny.json"
    argv = [
        "--model-path",
        tiny_model_dir,
        "--draft-path",
        draft,
        "--k",
        "1",
        "2",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        str(MAX_NEW),
        "--output",
        str(out),
    ]
    result = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["num_prompts"] == {"mtbench": 3, "humaneval": 3}
    assert result["mismatches"] == 0 and result["skipped"] == []
    assert set(result["results"]) == {"1", "2"}
    for k in (1, 2):
        for name in ("mtbench", "humaneval"):
            r = result["results"][str(k)][name]
            assert r["mismatches"] == 0
            assert len(r["accept_histogram"]) == k + 1
            # Every verify commits its accepted drafts + 1; the prefill adds one token each.
            accepted = sum(j * n for j, n in enumerate(r["accept_histogram"]))
            assert r["completion_tokens"] == 3 + r["verify_ct"] + accepted
            assert r["accept_length"] == pytest.approx(r["completion_tokens"] / r["verify_ct"])
            assert r["accept_length"] >= 1.0
            assert 1.0 <= r["mean_request_accept_length"] <= k + 1
            assert result["accept_length"][name][str(k)] == round(r["accept_length"], 4)
            assert r["completion_tokens"] == result["baseline"][name]["completion_tokens"]
    md = (tmp_path / "res" / "eagle3_accept_length_tiny.md").read_text()
    assert "| 2 | humaneval | 3 |" in md and "python benchmark/eagle3_accept_length.py" in md


def test_time_budget_skips_runs(bench, tiny_model_dir, tmp_path):
    out = tmp_path / "skipped.json"
    argv = ["--model-path", tiny_model_dir, "--k", "3", "1", "--num-prompts", "1"]
    result = bench.main([*argv, "--time-budget-s", "0.001", "--output", str(out)])
    assert result["skipped"] == ["3", "off", "1"]
    assert result["results"] == {} and result["mismatches"] is None
    assert "Skipped (time budget): ['3', 'off', '1']" in (tmp_path / "skipped.md").read_text()


def test_benchmark_sampled_coupled_keeps_the_reference(bench, tiny_model_dir, tmp_path):
    """--temperature > 0 samples every request with sampling_seed 0, and speculative_* engine
    args reach the speculative engines only (the reference would refuse them): with coupled
    sampling the speculative run commits the reference's tokens. The tiny random draft is
    almost never accepted, so this checks the plumbing; test_coupled_sampling.py checks the
    coupling itself with an oracle draft."""
    draft = make_tiny_eagle3_dir(str(tmp_path / "draft"), tiny_model_dir)
    out = tmp_path / "eagle3_accept_length_sampled.json"
    argv = ["--model-path", tiny_model_dir, "--draft-path", draft, "--k", "2"]
    argv += ["--datasets", "mtbench", "--num-prompts", "2", "--max-new-tokens", str(MAX_NEW)]
    argv += ["--temperature", "0.8", "--engine-arg", "speculative_coupled_sampling=true"]
    result = bench.main([*argv, "--output", str(out)])
    r = result["results"]["2"]["mtbench"]
    assert result["mismatches"] == 0 and r["mismatches"] == 0
    assert sum(r["accept_histogram"]) > 0  # it did verify drafts


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--k", "0"], "--k values must be >= 1"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_sizes_are_usage_errors(bench, capsys, argv, message):
    """A new-user helper (thirty-fourth session): --num-prompts 0 ran every prompt, --k 0 ended
    in a traceback from the engine."""
    assert_usage_error(bench.main, argv, message, capsys)
