"""EAGLE-3 accept length at K = 1..5 on held-out MT-Bench and HumanEval, through the engine.

    python benchmark/eagle3_accept_length.py --draft-path DIR [--model-path PATH] \
        --k 1 2 3 4 5 --datasets mtbench humaneval --num-prompts N --max-new-tokens 256 \
        --output benchmark/results/eagle3_accept_length_<tag>.json

One sglang.Engine without speculation runs first (the greedy reference); then, for each K, one
Engine(speculative_algorithm="EAGLE3", speculative_num_steps=K). Each dataset goes in as one
batched greedy generate. Per K and dataset, from the responses' meta_info:

- accept_length = sum(completion_tokens) / sum(spec_verify_ct): tokens per verify, bonus
  included (upstream's definition; the prefill token counts, as upstream's does);
- mean_request_accept_length: mean of the per-request spec_accept_length;
- accept_histogram: summed spec_accept_histogram ([j] = verifies that accepted j drafts);
- tokens_per_s: completion tokens / wall time of the generate call;
- mismatches: requests whose output_ids differ from the reference run (must be 0 when greedy;
  with --temperature > 0 every request samples with sampling_seed 0, and only coupled sampling,
  `--engine-arg speculative_coupled_sampling=true`, keeps the reference's tokens, up to the
  rounding of the verify forward against the plain one: on the H200 in bf16 that rounding
  moved 13 of 16 MT-Bench requests within 64 tokens at temperature 0.7, against 16 of 16 with
  rejection sampling, twenty-second session).

Prompts come from benchmark/data/ (scripts/prepare_draft_data.py). MT-Bench: the first turn of
each question under the chat template. HumanEval (--humaneval-format): "chat" (default) sends
HUMANEVAL_INSTRUCTION + the prompt as one user message under the chat template, as the draft was
trained on chat-templated data and the target is an instruct model; "raw" sends the prompt text
alone (plain completion). JSON and a markdown table are rewritten after every engine run, so a
run cut short keeps what it measured; --time-budget-s skips the runs that would not fit (the
next run is assumed to take 1.2 x the previous one). The first K of --k runs before the
reference, so that its accept length survives even a very short budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DATA_FILES = {"mtbench": "mtbench_questions.jsonl", "humaneval": "humaneval_prompts.jsonl"}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="EAGLE-3 accept length through sglang.Engine.")
    p.add_argument("--draft-path", default=None, help="EAGLE-3 draft (default: engine default)")
    p.add_argument("--model-path", default=None, help="target (default: bundled SmolLM2)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="draft lengths")
    p.add_argument("--datasets", nargs="+", default=list(DATA_FILES), choices=list(DATA_FILES))
    p.add_argument("--num-prompts", type=int, default=None, help="per dataset (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: seeded sampling (mismatches are then expected with rejection sampling, and "
        "0 up to rounding with --engine-arg speculative_coupled_sampling=true)",
    )
    p.add_argument("--humaneval-format", default="chat", choices=["chat", "raw"])
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 CUDA, fp32 CPU)")
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--time-budget-s", type=float, default=None, help="skip runs past this")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra ServerArgs field for every engine (VALUE parsed as JSON when it can be)",
    )
    p.add_argument("--output", default="benchmark/results/eagle3_accept_length.json")
    return p


def load_prompts(data_dir: str, dataset: str, num: int | None) -> list[str]:
    """First `num` prompts of benchmark/data/<dataset file> ("prompt" field of each line).

    Raises FileNotFoundError (run scripts/prepare_draft_data.py) when the file is missing.
    """
    path = os.path.join(data_dir, DATA_FILES[dataset])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} missing: run python scripts/prepare_draft_data.py")
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:num] if num else prompts


def encode_prompts(tokenizer: Any, dataset: str, prompts: list[str], fmt: str) -> list[list[int]]:
    """Token ids sent to the engine: chat-templated user turns, or the raw HumanEval text."""
    if dataset == "humaneval" and fmt == "raw":
        return [list(tokenizer.encode(p)) for p in prompts]
    out = []
    for p in prompts:
        text = HUMANEVAL_INSTRUCTION.format(prompt=p) if dataset == "humaneval" else p
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix)."""
    return next(
        (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def summarize(outs: list[dict], wall_s: float, reference: list[list[int]] | None) -> dict:
    """Accept-length statistics of one batched generate (see module doc)."""
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    res: dict[str, Any] = {"completion_tokens": tokens, "wall_s": round(wall_s, 3)}
    res["tokens_per_s"] = round(tokens / max(wall_s, 1e-9), 2)
    if "spec_verify_ct" in metas[0]:
        verifies = sum(m["spec_verify_ct"] for m in metas)
        hist = [0] * max(len(m["spec_accept_histogram"]) for m in metas)
        for m in metas:
            for j, n in enumerate(m["spec_accept_histogram"]):
                hist[j] += n
        res["verify_ct"] = verifies
        res["accept_length"] = tokens / max(verifies, 1)
        per_request = [m["spec_accept_length"] for m in metas]
        res["mean_request_accept_length"] = sum(per_request) / len(per_request)
        res["accept_histogram"] = hist
        proposed = sum(m["spec_num_proposed_drafts"] for m in metas)
        res["draft_accept_rate"] = sum(m["spec_num_correct_drafts"] for m in metas) / max(
            proposed, 1
        )
    if reference is not None:
        diffs = []
        for i, (o, ref) in enumerate(zip(outs, reference, strict=True)):
            if o["output_ids"] != ref:
                diffs.append({"index": i, "first_diff_token": _first_diff(o["output_ids"], ref)})
        res["mismatches"] = len(diffs)
        res["mismatch_detail"] = diffs[:10]
    return res


def run_engine(
    model_path: str | None,
    inputs: dict[str, list[list[int]]],
    max_new_tokens: int,
    temperature: float = 0.0,
    **kw: Any,
) -> tuple[dict[str, list[dict]], dict[str, float], float]:
    """Start one Engine, send each dataset as one batched generate (greedy at temperature 0,
    else sampled with sampling_seed 0), shut it down. Returns (outputs per dataset, generate
    wall seconds per dataset, startup seconds)."""
    from sglang.srt.entrypoints.engine import Engine

    params: dict[str, Any] = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    if temperature > 0:  # seeded: the reference and each K sample from the same streams
        params["sampling_seed"] = 0
    t0 = time.perf_counter()
    outs, walls = {}, {}
    with Engine(model_path=model_path, random_seed=0, log_level="warning", **kw) as engine:
        startup = time.perf_counter() - t0
        for name, ids in inputs.items():
            t1 = time.perf_counter()
            outs[name] = engine.generate(input_ids=ids, sampling_params=params)
            walls[name] = time.perf_counter() - t1
    return outs, walls, startup


def _engine_extra(pairs: list[str]) -> dict[str, Any]:
    extra = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            extra[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            extra[key.replace("-", "_")] = value
    return extra


def sampling_words(result: dict) -> str:
    """'greedy', or 'temperature T, seeded' for a sampled run (older results: greedy)."""
    t = result.get("temperature") or 0.0
    return f"temperature {t:g}, seeded" if t > 0 else "greedy"


def write_report(result: dict, json_path: str) -> str:
    """Write result as JSON at json_path and a markdown table next to it; returns the .md path."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    md_path = os.path.splitext(json_path)[0] + ".md"
    lines = [
        "# EAGLE-3 accept length",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Target `{result['model_path']}`, draft `{result['draft_path']}`, device "
        f"{result['device']}, dtype {result['dtype']}, {sampling_words(result)}, max_new_tokens "
        f"{result['max_new_tokens']}, HumanEval format {result['humaneval_format']}. Accept "
        "length = sum(completion_tokens) / sum(spec_verify_ct) (tokens per verify, bonus "
        "included); per-req = mean of per-request spec_accept_length; mismatches = requests "
        "whose output differs from the run without speculation (same seeds when sampled).",
        "",
        "| K | dataset | prompts | accept length | per-req mean | tokens/s | speedup | "
        "mismatches | accept histogram |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, base in result["baseline"].items():
        n = result["num_prompts"][name]
        lines.append(f"| off | {name} | {n} | - | - | {base['tokens_per_s']:.1f} | 1.00 | - | - |")
    for k in sorted(result["results"], key=int):
        for name, r in result["results"][k].items():
            base = result["baseline"].get(name)
            speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
            lines.append(
                f"| {k} | {name} | {result['num_prompts'][name]} | {r['accept_length']:.3f} | "
                f"{r['mean_request_accept_length']:.3f} | {r['tokens_per_s']:.1f} | {speedup} | "
                f"{r.get('mismatches', 'n/a')} | {r['accept_histogram']} |"
            )
    total = result["mismatches"]
    lines += ["", f"Total mismatches: {'n/a (no reference run)' if total is None else total}."]
    if result["skipped"]:
        lines.append(f"Skipped (time budget): {result['skipped']} ('off' = the reference).")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return md_path


def _refresh(result: dict, raw: dict) -> None:
    """Recompute result["baseline"/"results"/"accept_length"/"mismatches"] from the raw
    outputs of the runs so far, raw[key] = (outputs per dataset, wall s per dataset), key
    "off" for the reference run and str(K) for speculative ones."""
    ref = raw.get("off")
    if ref is not None:
        result["baseline"] = {d: summarize(o, ref[1][d], None) for d, o in ref[0].items()}
    result["mismatches"] = 0 if ref is not None else None
    result["accept_length"] = {d: {} for d in result["num_prompts"]}
    for key in sorted((k for k in raw if k != "off"), key=int):
        outs, walls = raw[key]
        per_ds = {}
        for d, o in outs.items():
            reference = [r["output_ids"] for r in ref[0][d]] if ref is not None else None
            per_ds[d] = summarize(o, walls[d], reference)
            result["accept_length"][d][key] = round(per_ds[d]["accept_length"], 4)
            if ref is not None:
                result["mismatches"] += per_ds[d]["mismatches"]
        result["results"][key] = per_ds


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see module doc); returns the result dict also written to --output.

    Run order: the first K of --k, the reference (no speculation), the other Ks; so a run cut
    short by a time limit still has the first K. Mismatches are None until the reference ran.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.k) < 1:  # 0 is no speculation: the reference run, always made
        parser.error(f"--k values must be >= 1, got {min(args.k)}")
    if args.num_prompts is not None and args.num_prompts < 1:  # 0 read as "all" before
        parser.error(f"--num-prompts must be >= 1 (leave it out for all), got {args.num_prompts}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    import torch
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.loader import resolve_model_path

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path))
    prompts = {d: load_prompts(args.data_dir, d, args.num_prompts) for d in args.datasets}
    inputs = {d: encode_prompts(tokenizer, d, p, args.humaneval_format) for d, p in prompts.items()}
    extra = {"dtype": args.dtype, **_engine_extra(args.engine_arg)}
    cuda = torch.cuda.is_available() and extra.get("device", "auto") != "cpu"
    argv_text = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    result: dict[str, Any] = {
        "command": f"python benchmark/eagle3_accept_length.py {argv_text}".strip(),
        "model_path": args.model_path or "bundled SmolLM2-135M-Instruct",
        "draft_path": args.draft_path or "engine default",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "humaneval_format": args.humaneval_format,
        "num_prompts": {d: len(p) for d, p in prompts.items()},
        "baseline": {},
        "results": {},
        "accept_length": {d: {} for d in prompts},
        "startup_s": {},
        "mismatches": None,
        "skipped": [],
    }
    raw: dict[str, tuple] = {}
    last_run = 0.0
    for key in [str(args.k[0]), "off", *(str(k) for k in args.k[1:])]:
        elapsed = time.perf_counter() - start
        if args.time_budget_s is not None and elapsed + 1.2 * last_run > args.time_budget_s:
            result["skipped"].append(key)
            continue
        t0 = time.perf_counter()
        spec = {}
        kw = extra
        if key != "off":
            spec = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": int(key)}
            if args.draft_path:
                spec["speculative_draft_model_path"] = args.draft_path
        else:  # the reference runs without speculation: its engine takes no speculative_* args
            kw = {k: v for k, v in extra.items() if not k.startswith("speculative_")}
        outs, walls, result["startup_s"][key] = run_engine(
            args.model_path, inputs, args.max_new_tokens, args.temperature, **kw, **spec
        )
        raw[key] = (outs, walls)
        _refresh(result, raw)
        write_report(result, args.output)
        last_run = time.perf_counter() - t0
    result["total_s"] = round(time.perf_counter() - start, 1)
    md = write_report(result, args.output)
    print(json.dumps(result["accept_length"]), f"mismatches={result['mismatches']}", md)
    return result


if __name__ == "__main__":
    main()
