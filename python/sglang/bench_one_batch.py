"""Latency of one static batch: prefill and decode throughput of the engine's scheduler step,
and, in the same run, Hugging Face transformers `generate` on the same model and machine.

    python -m sglang.bench_one_batch --batch-size 1 8 --input-len 128 --output-len 32 \
        --result-file benchmark/results/bench_one_batch_cpu.json

Upstream's bench_one_batch drives the model runner without the HTTP server; this one drives
the in-process Scheduler (same batching code as the server), so the numbers include scheduling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_resolve import resolve_server_args


def make_inputs(bs: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (bs, input_len), generator=g).tolist()


def bench_engine(sched: Scheduler, inputs: list[list[int]], output_len: int) -> dict:
    """One prefill step for the whole batch, then the decode steps of the other output_len - 1
    tokens of each request (fewer steps than tokens with speculative decoding: decode_tok_s
    counts tokens, decode_step_ms divides by steps)."""
    for i, ids in enumerate(inputs):
        sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        sp.normalize(None)
        sched.handle_message(
            TokenizedGenerateReqInput(f"b{i}", None, ids, sp, False, -1, 0, False, seed=i)
        )
    sync = torch.cuda.synchronize if sched.tp_worker.device.type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    prefill_tokens = decode_steps = 0
    t_prefill = 0.0
    while not sched.is_idle():
        batch = sched.step()
        sync()
        if batch is not None and batch.forward_mode == ForwardMode.EXTEND:
            prefill_tokens += sum(len(r.origin_input_ids) for r in batch.reqs)
            t_prefill = time.perf_counter() - t0
        elif batch is not None:
            decode_steps += 1
    total = time.perf_counter() - t0
    t_decode = total - t_prefill
    bs = len(inputs)
    sched.flush_cache()
    return {
        "prefill_s": t_prefill,
        "prefill_tok_s": prefill_tokens / t_prefill,
        "decode_s": t_decode,
        # every request makes exactly output_len tokens (ignore_eos), the first in its prefill
        "decode_tok_s": bs * (output_len - 1) / t_decode if decode_steps else 0.0,
        "decode_step_ms": 1000 * t_decode / max(1, decode_steps),
        "decode_steps": decode_steps,
    }


def bench_hf(model_path: str, dtype, device, inputs: list[list[int]], output_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    ids = torch.tensor(inputs, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    kw = {"do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        sync()
        t0 = time.perf_counter()
        model(ids)
        sync()
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        sync()
        total = time.perf_counter() - t0
    t_decode = max(1e-9, total - t_prefill)
    bs = len(inputs)
    return {
        "prefill_tok_s": bs * len(inputs[0]) / t_prefill,
        "decode_tok_s": bs * (output_len - 1) / t_decode,
        "decode_step_ms": 1000 * t_decode / max(1, output_len - 1),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, nargs="+", default=[128])
    p.add_argument("--output-len", type=int, nargs="+", default=[32])
    p.add_argument("--skip-hf", action="store_true", help="Do not run HF transformers.")
    p.add_argument("--result-file", type=str, default=None, help="Write results as JSON.")
    args = p.parse_args(argv)
    for flag, values, low in (
        ("--batch-size", args.batch_size, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 0),
    ):
        if min(values) < low:
            p.error(f"{flag} must be >= {low}, got {min(values)}")
    if args.result_file:
        folder = os.path.dirname(os.path.abspath(args.result_file))
        if not os.path.isdir(folder):
            p.error(f"--result-file: folder {folder} does not exist")
    sa = resolve_server_args(ServerArgs.from_cli_args(args))
    mc = ModelConfig(sa.model_path, sa.context_length, sa.dtype, sa.device)
    longest = max(args.input_len) + max(args.output_len)
    if longest > mc.context_len:
        p.error(
            f"--input-len + --output-len ({longest}) exceeds the model's context length "
            f"({mc.context_len})"
        )
    sched = Scheduler(sa, mc)
    rows = []
    for bs in args.batch_size:
        for il in args.input_len:
            for ol in args.output_len:
                inputs = make_inputs(bs, il, mc.vocab_size, seed=bs * 1000 + il)
                bench_engine(sched, make_inputs(bs, il, mc.vocab_size, 7), 4)  # warm-up
                row = {"batch_size": bs, "input_len": il, "output_len": ol}
                row["sglang"] = bench_engine(sched, inputs, ol)
                if not args.skip_hf and args.load_format != "dummy":
                    row["hf_transformers"] = bench_hf(
                        sa.model_path, mc.dtype, sa.device, inputs, ol
                    )
                    row["decode_speedup_vs_hf"] = (
                        row["sglang"]["decode_tok_s"] / row["hf_transformers"]["decode_tok_s"]
                    )
                print(json.dumps(row))
                rows.append(row)
    if args.result_file:
        meta = {
            "command": "python -m sglang.bench_one_batch " + " ".join(argv or []),
            "device": sa.device,
            "torch": torch.__version__,
            "server_args": dataclasses.asdict(sa),
        }
        with open(args.result_file, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
