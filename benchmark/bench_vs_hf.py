"""Decode throughput of this engine against HF transformers `generate` (issue 6, benchmark 2).

    python benchmark/bench_vs_hf.py [--batch-sizes 1 8 64 256] [--input-len 128] \
        [--output-len 128] [--hf-cache static [dynamic]] \
        [--result-file benchmark/results/vs_hf_h200.json] [any launch_server flag]

Model: the bundled SmolLM2-135M-Instruct (or --model-path), in --dtype (default bfloat16).
Both sides get the same random prompt ids (batch x input_len, one seed per batch size) and
generate greedily exactly output_len tokens (ignore_eos / min_new_tokens).

- Engine: one sglang.Engine (server defaults: CUDA graphs, overlap, ... unless flags say
  otherwise) serves every batch size as one batched generate call.
- HF: AutoModelForCausalLM.from_pretrained(the same converted checkpoint directory the engine
  loads, dtype) on the same device, `generate(cache_implementation=...)` ("static" by default:
  a StaticCache; no torch.compile), after the engine has been shut down.

Decode time = time(generate output_len tokens) - time(generate 1 token), both after a warm-up
and with the engine's prefix cache flushed, so prefill and fixed overheads cancel; decode
tokens/s = batch x (output_len - 1) / decode time, the best of --repeats. speedup = engine /
HF per batch size. A failing batch size or side records its error and the rest goes on; the
JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import engine_kwargs, error_record, run_meta, sync, write_json


def build_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (best kept)")
    p.add_argument(
        "--hf-cache",
        nargs="+",
        default=["static"],
        help="HF cache_implementation values to run ('dynamic' = HF's default cache)",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--result-file", default=None)
    return p


def make_inputs(bs: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (bs, input_len), generator=g).tolist()


def decode_rate(timed: Callable[[int], float], bs: int, output_len: int, repeats: int) -> dict:
    """Best-of-`repeats` decode tokens/s from timed(n) = seconds to generate n tokens."""
    full, one = [], []
    for _ in range(repeats):
        one.append(timed(1))
        full.append(timed(output_len))
    t_one, t_full = min(one), min(full)
    decode_s = max(t_full - t_one, 1e-9)
    return {
        "gen_1_s": t_one,
        "gen_full_s": t_full,
        "gen_full_s_all": full,
        "decode_s": decode_s,
        "decode_tok_s": bs * (output_len - 1) / decode_s,
        "decode_step_ms": 1000 * decode_s / max(1, output_len - 1),
    }


def bench_engine(args: argparse.Namespace, result: dict, save: Callable[[], None]) -> None:
    from sglang.srt.entrypoints.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(**engine_kwargs(args))
    result["engine_start_s"] = time.perf_counter() - t0
    result["server_args"] = {k: v for k, v in vars(engine.server_args).items() if k != "api_key"}
    try:
        for row in result["rows"]:
            bs, inputs = row["batch_size"], row["_inputs"]

            def timed(n: int, inputs: list[list[int]] = inputs) -> float:
                engine.flush_cache()
                params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                t = time.perf_counter()
                outs = engine.generate(input_ids=inputs, sampling_params=params)
                dt = time.perf_counter() - t
                got = [o["meta_info"]["completion_tokens"] for o in outs]
                if got != [n] * len(inputs):
                    raise RuntimeError(f"expected {n} tokens per request, got {sorted(set(got))}")
                return dt

            try:
                timed(4)  # warm-up at this batch size
                row["sglang"] = decode_rate(timed, bs, args.output_len, args.repeats)
            except Exception as e:  # noqa: BLE001 - record, next batch size
                row["sglang"] = {"error": error_record(e)}
            print(f"engine bs={bs}:", row["sglang"], flush=True)
            save()
    finally:
        engine.shutdown()


def bench_hf(args: argparse.Namespace, model_dir: str, result: dict, save: Callable) -> None:
    from transformers import AutoModelForCausalLM

    from sglang.srt.configs.model_config import ModelConfig

    device = result["device"]
    dtype = ModelConfig(model_dir, None, args.dtype, device).dtype
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    result["hf_load_s"] = time.perf_counter() - t0
    result["hf_dtype"] = str(dtype)
    for cache in args.hf_cache:
        for row in result["rows"]:
            bs, inputs = row["batch_size"], row["_inputs"]
            ids = torch.tensor(inputs, device=device)
            mask = torch.ones_like(ids)
            kw: dict[str, Any] = {"do_sample": False, "pad_token_id": 0, "attention_mask": mask}
            if cache != "dynamic":
                kw["cache_implementation"] = cache

            def timed(n: int, ids: torch.Tensor = ids, kw: dict = kw) -> float:
                sync(device)
                t = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                sync(device)
                dt = time.perf_counter() - t
                if out.shape[1] != ids.shape[1] + n:
                    raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} != {n}")
                return dt

            key = f"hf_{cache}"
            try:
                timed(4)  # warm-up
                row[key] = decode_rate(timed, bs, args.output_len, args.repeats)
            except Exception as e:  # noqa: BLE001
                row[key] = {"error": error_record(e)}
            del ids, mask
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"{key} bs={bs}:", row[key], flush=True)
            speedup(row)
            save()


def speedup(row: dict) -> None:
    ours = row.get("sglang", {}).get("decode_tok_s")
    for key in [k for k in row if k.startswith("hf_")]:
        theirs = row[key].get("decode_tok_s")
        if ours and theirs:
            row[f"speedup_vs_{key}"] = ours / theirs


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import resolve_model_path
    from sglang.srt.server_args_resolve import resolve_device

    device = resolve_device(args.device)
    model_dir = resolve_model_path(args.model_path)
    vocab = ModelConfig(model_dir, None, args.dtype, device).vocab_size
    result: dict[str, Any] = {
        "meta": run_meta(["benchmark/bench_vs_hf.py"] + argv),
        "device": device,
        "model_dir": model_dir,
        "settings": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "hf_cache": args.hf_cache,
            "hf_torch_compile": False,
        },
        "rows": [
            {"batch_size": bs, "_inputs": make_inputs(bs, args.input_len, vocab, 1000 + bs)}
            for bs in args.batch_sizes
        ],
    }

    def save() -> None:
        if args.result_file:
            rows = [{k: v for k, v in r.items() if k != "_inputs"} for r in result["rows"]]
            write_json(args.result_file, {**result, "rows": rows})

    for name, skip, fn in (
        ("engine", args.skip_engine, lambda: bench_engine(args, result, save)),
        ("hf", args.skip_hf, lambda: bench_hf(args, model_dir, result, save)),
    ):
        if skip:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record, run the other side
            result[f"{name}_error"] = error_record(e)
            print(f"{name} failed:", result[f"{name}_error"], flush=True)
        save()
    for row in result["rows"]:
        speedup(row)
        row.pop("_inputs", None)
    save()
    for row in result["rows"]:
        print({k: v.get("decode_tok_s") if isinstance(v, dict) else v for k, v in row.items()})
    return result


if __name__ == "__main__":
    main()
