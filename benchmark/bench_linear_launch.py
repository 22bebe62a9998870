"""Host cost of launching the linear layers of an eager prefill: microseconds of CPU per
`F.linear` call, by row count M, weight shape and BLAS backend.

    python benchmark/bench_linear_launch.py \
        [--result-file benchmark/results/linear_launch_h200.json]

Why: on the H200 an eager prefill is host-bound (the 8B shape's 256-token prefill launched for
26 ms, SmolLM2's for ~30 ms at 60 tokens; `ttft_8b_bs1_timeline2_h200_s11.json`,
`decode_step_smollm2_bs16_ttft_h200_s13.json`), and the tenth session's torch.profiler table
of SmolLM2 prefills put ~74 us of CPU in each `aten::mm` (against 4 us of GPU). This tells
whether the BLAS call itself is that slow on the host, for which M, whether a shape seen before
is cheaper than a new one (a per-shape heuristic query), and whether cuBLASLt or cuBLAS
(`torch.backends.cuda.preferred_blas_library`) is cheaper. Padding the token count of a
prefill to a few buckets would make every shape a seen one.

Method: the GPU is kept busy first (`torch.cuda._sleep`), so enqueuing never waits on it; the
host then enqueues `--calls` calls of one (M, shape) and the wall time per call is what the
host spent launching it ("warm": the same shape called just before; "cold": the first call of
an M never used in the process). Shapes: Llama-3.1-8B (qkv, o, gate_up, down) and SmolLM2-135M
(the same four), bf16. `--device cpu` only checks the script (numbers meaningless).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_common import run_meta, write_json

SHAPES = {  # name: (N out, K in)
    "8b_qkv": (6144, 4096),
    "8b_o": (4096, 4096),
    "8b_gate_up": (28672, 4096),
    "8b_down": (4096, 14336),
    "smollm2_qkv": (960, 576),
    "smollm2_o": (576, 576),
    "smollm2_gate_up": (3072, 576),
    "smollm2_down": (576, 1536),
}


def busy(device: str) -> None:
    """Keep the GPU busy for ~50 ms so that the host's enqueues do not wait for it."""
    if device == "cuda":
        torch.cuda._sleep(100_000_000)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_us_per_call(x: torch.Tensor, w: torch.Tensor, calls: int, device: str) -> float:
    """Wall microseconds per F.linear(x, w) enqueue, `calls` in a row behind a busy GPU."""
    busy(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        F.linear(x, w)
    t = time.perf_counter() - t0
    sync(device)
    return 1e6 * t / calls


def measure(args: argparse.Namespace, backend: str) -> dict:
    dev, dtype = args.device, getattr(torch, args.dtype)
    if backend != "default" and dev == "cuda":
        torch.backends.cuda.preferred_blas_library(backend)
    out: dict = {}
    cold_m = 1000  # each cold measurement takes an M not used before in this process
    for name, (n, k) in SHAPES.items():
        if args.only and not name.startswith(args.only):
            continue
        w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
        row: dict = {}
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            F.linear(x, w)  # the shape's first call (heuristics, any lazy init)
            sync(dev)
            row[f"warm_m{m}"] = round(host_us_per_call(x, w, args.calls, dev), 2)
        colds = []
        for _ in range(args.cold_samples):
            cold_m += 1
            x = torch.randn(cold_m, k, device=dev, dtype=dtype)
            sync(dev)
            busy(dev)
            t0 = time.perf_counter()
            F.linear(x, w)
            colds.append(1e6 * (time.perf_counter() - t0))
            sync(dev)
        row["cold_us_median"] = round(sorted(colds)[len(colds) // 2], 2) if colds else None
        out[name] = row
        print(backend, name, row, flush=True)
        del w
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 47, 64, 128, 256, 999])
    p.add_argument("--calls", type=int, default=200, help="enqueues per warm measurement")
    p.add_argument("--cold-samples", type=int, default=9, help="new-M calls per shape")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["default", "cublas", "cublaslt"],
        help="torch.backends.cuda.preferred_blas_library values (default: leave it)",
    )
    p.add_argument("--only", default=None, help="shapes whose name starts with this")
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --device cpu to check the script)")
    result = {"meta": run_meta(argv), "settings": vars(args), "backends": {}}
    for backend in args.backends:
        result["backends"][backend] = measure(args, backend)
        if args.result_file:
            write_json(args.result_file, result)
    return result


if __name__ == "__main__":
    main()
