"""Single-stream decode speed against the memory roofline (issue 6, benchmark 1).

    python benchmark/bench_decode_roofline.py \
        [--model-path benchmark/configs/llama31_8b_dummy --load-format dummy --dtype bfloat16] \
        [--input-len 128 --output-len 256 --repeats 3 --copy-gib 4] \
        [--result-file benchmark/results/decode_roofline_h200.json] [any launch_server flag]

One sglang.Engine (CUDA graphs and every other server default on unless flags say otherwise)
decodes one request at a time: input_len random prompt ids, output_len greedy tokens,
ignore_eos, streamed. Per repeat (fresh prompt ids each, so the radix cache never helps):

- ttft_s: send -> first streamed token;
- decode_tok_s = (tokens at the last chunk - tokens at the first) / (time between them),
  step_ms = 1000 / decode_tok_s (batch 1: one token per step), e2e_s.

The reported numbers are the median repeat's. In the same run, before the engine starts, a
device-to-device copy of --copy-gib GiB measures the copy bandwidth ((read + write bytes) /
time, 10 copies after 2 warm-ups; --copy-device cpu on CPU, --skip-bandwidth to skip). Weight
bytes per step come from config.json (bench_common.llama_weight_bytes: every layer, final norm,
lm_head; the embedding as one row). roofline_fraction = (weight_bytes / bandwidth) / step time:
1.0 would mean the step reads its weights at copy speed and does nothing else. KV bytes per
step (the mean context) are reported beside it but not counted. Every stage records its error
in the JSON and the script goes on (the JSON is rewritten after each stage).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from bench_common import (
    REPO,
    engine_kwargs,
    error_record,
    kv_bytes_per_token,
    llama_weight_bytes,
    measure_copy_bandwidth,
    run_meta,
    write_json,
)

DEFAULT_MODEL = f"{REPO}/benchmark/configs/llama31_8b_dummy"


def build_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.set_defaults(model_path=DEFAULT_MODEL, load_format="dummy", dtype="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-gib", type=float, default=4.0, help="copy buffer size (GiB)")
    p.add_argument("--copy-device", default="auto", help="auto (cuda if present), cuda, cpu")
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--result-file", default=None, help="JSON output (default: print only)")
    return p


def stream_one(engine: Any, ids: list[int], output_len: int) -> dict[str, float]:
    """Stream one greedy request; timing from the chunks' arrival (see the module doc)."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    marks: list[tuple[float, int]] = []
    for out in engine.generate(input_ids=ids, sampling_params=params, stream=True):
        n = int(out["meta_info"]["completion_tokens"])
        if not marks or n > marks[-1][1]:
            marks.append((time.perf_counter(), n))
    e2e = time.perf_counter() - t0
    (t_first, n_first), (t_last, n_last) = marks[0], marks[-1]
    span = t_last - t_first
    tok_s = (n_last - n_first) / span if span > 0 and n_last > n_first else float("nan")
    return {
        "completion_tokens": n_last,
        "chunks": len(marks),
        "ttft_s": t_first - t0,
        "e2e_s": e2e,
        "decode_tok_s": tok_s,
        "step_ms": 1000.0 / tok_s if tok_s == tok_s and tok_s > 0 else float("nan"),
    }


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import resolve_model_path
    from sglang.srt.server_args_resolve import resolve_device

    result: dict[str, Any] = {"meta": run_meta(["benchmark/bench_decode_roofline.py"] + argv)}
    result["settings"] = {
        "model_path": args.model_path,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "batch_size": 1,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
    }
    save = (lambda: write_json(args.result_file, result)) if args.result_file else lambda: None
    device = resolve_device(args.device)
    mc = ModelConfig(resolve_model_path(args.model_path), args.context_length, args.dtype, device)
    dtype_bytes = torch.empty((), dtype=mc.dtype).element_size()
    wb = llama_weight_bytes(mc.hf_config, dtype_bytes)
    result["model"] = {"config": repr(mc), "dtype_bytes": dtype_bytes, "weight_bytes": wb}
    result["model"]["kv_bytes_per_token"] = kv_bytes_per_token(mc.hf_config, dtype_bytes)

    if not args.skip_bandwidth:
        copy_dev = args.copy_device if args.copy_device != "auto" else device
        try:
            result["bandwidth"] = measure_copy_bandwidth(int(args.copy_gib * 2**30), copy_dev)
            result["bandwidth"]["device"] = copy_dev
        except Exception as e:  # noqa: BLE001 - record and go on
            result["bandwidth"] = {"error": error_record(e)}
        print("bandwidth:", result["bandwidth"], flush=True)
        save()

    from sglang.srt.entrypoints.engine import Engine

    t0 = time.perf_counter()
    try:
        engine = Engine(**engine_kwargs(args))
    except Exception as e:  # noqa: BLE001
        result["error"] = "engine start: " + error_record(e)
        save()
        return result
    result["engine_start_s"] = time.perf_counter() - t0
    result["server_args"] = {k: v for k, v in vars(engine.server_args).items() if k != "api_key"}
    gen = torch.Generator().manual_seed(0)
    vocab = mc.vocab_size

    def prompt() -> list[int]:
        return torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()

    runs: list[dict] = []
    result["runs"] = runs
    try:
        stream_one(engine, prompt(), 16)  # warm-up
        for _ in range(args.repeats):
            try:
                runs.append(stream_one(engine, prompt(), args.output_len))
            except Exception as e:  # noqa: BLE001
                runs.append({"error": error_record(e)})
            print("run:", runs[-1], flush=True)
            save()
    except Exception as e:  # noqa: BLE001
        result["error"] = "warm-up: " + error_record(e)
    finally:
        engine.shutdown()
    summarize(result)
    save()
    return result


def summarize(result: dict) -> None:
    """Median repeat's speed, and the roofline fraction when the bandwidth is known."""
    ok = [r for r in result.get("runs", []) if "error" not in r and r["decode_tok_s"] > 0]
    if not ok:
        return
    med = sorted(ok, key=lambda r: r["decode_tok_s"])[len(ok) // 2]
    s: dict[str, Any] = {
        "decode_tok_s": med["decode_tok_s"],
        "step_ms": med["step_ms"],
        "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in ok),
        "decode_tok_s_all": [r["decode_tok_s"] for r in ok],
    }
    weight_bytes = result["model"]["weight_bytes"]["total"]
    settings = result["settings"]
    mean_ctx = settings["input_len"] + settings["output_len"] / 2
    s["weight_bytes_per_step"] = weight_bytes
    s["kv_bytes_per_step_mean"] = mean_ctx * result["model"]["kv_bytes_per_token"]
    bw = result.get("bandwidth", {}).get("bandwidth_gb_s")
    if bw:
        ideal_s = weight_bytes / (bw * 1e9)
        s["copy_bandwidth_gb_s"] = bw
        s["roofline_step_ms"] = 1000 * ideal_s
        s["roofline_tok_s"] = 1.0 / ideal_s
        s["roofline_fraction"] = ideal_s / (med["step_ms"] / 1000.0)
        s["weight_read_gb_s"] = weight_bytes / (med["step_ms"] / 1000.0) / 1e9
    result["summary"] = s
    print("summary:", s, flush=True)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
