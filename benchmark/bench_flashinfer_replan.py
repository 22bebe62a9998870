"""Host cost of re-planning a FlashInfer CUDA-graph wrapper before a replay: FlashInfer's
plan() against flashinfer_replan's lean re-plan, both without the C++ plan itself:

    python benchmark/bench_flashinfer_replan.py \
        --result-file benchmark/results/flashinfer_replan_host_cpu.json

The wrappers are built over CPU buffers and their compiled module is replaced by a no-op
(sglang.test.flashinfer_cpu, as in test_flashinfer_replan.py), so this times the Python
around the C++ call (what the lean path removes), on any machine with flashinfer-python
installed. On the GPU host the copies are
host-to-device and the C++ plan runs too: `scripts/gpu_diagnose.sh FL` measures the step.
Microseconds per call (median of --rounds rounds of --calls calls), per kind: decode on CUDA
cores (GQA 3, SmolLM2), decode on tensor cores (GQA 4, Llama-3.1-8B), causal prefill (verify).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import append_run, git_commit_of_cwd


class NoOpModule:
    def plan(self, *args):
        return [0]


def calls_of(kind: str, bs: int, nkv: int):
    """(plan() call, lean call) for one kind of graph wrapper of batch size bs, each on its own
    CPU wrapper planned once (the lean one then keeps plan()'s module, as after a capture)."""
    import flashinfer

    from sglang.srt.layers.attention.flashinfer_replan import GraphReplanner
    from sglang.srt.layers.attention.paged_layout import paged_layout
    from sglang.test.flashinfer_cpu import graph_wrapper_on_cpu

    nq, d, dt = 12, 64, torch.bfloat16
    i32 = dict(dtype=torch.int32)
    seq = [100 + 7 * i for i in range(bs)]
    ext = [1 + i % 3 for i in range(bs)] if kind == "verify" else [1] * bs
    layout = paged_layout(seq, ext, 3 * bs if kind == "verify" else bs)
    indices = torch.zeros(layout.num_pages, **i32)
    kw = dict(q_data_type=dt, kv_data_type=dt, sm_scale=0.125, non_blocking=True)

    def make():
        if kind == "verify":
            return graph_wrapper_on_cpu(
                flashinfer.BatchPrefillWithPagedKVCacheWrapper, NoOpModule(),
                qo_indptr_buf=torch.zeros(bs + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(bs + 1, **i32),
                paged_kv_indices_buf=torch.zeros(bs * 2048, **i32),
                paged_kv_last_page_len_buf=torch.ones(bs, **i32), backend="fa2",
            )  # fmt: skip
        return graph_wrapper_on_cpu(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper, NoOpModule(),
            use_tensor_cores=kind == "decode_tensor_cores",
            paged_kv_indptr_buffer=torch.zeros(bs + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(bs * 2048, **i32),
            paged_kv_last_page_len_buffer=torch.ones(bs, **i32), backend="fa2",
        )  # fmt: skip

    def plan(w):
        if kind == "verify":
            w.plan(
                layout.qo_indptr, layout.kv_indptr, indices, layout.last_page_len, nq, nkv, d,
                1, causal=True, **kw,
            )  # fmt: skip
        else:
            w.plan(layout.kv_indptr, indices, layout.last_page_len, nq, nkv, d, 1, **kw)

    full, lean = make(), make()
    plan(full)
    plan(lean)
    lean._jit_module = None  # plan() kept the module; the lean path calls it
    rp = GraphReplanner(nq, nkv, d, dt)
    if kind == "verify":
        return (lambda: plan(full)), (
            lambda: rp.replan_prefill(lean, layout.qo_indptr, layout.kv_indptr)
        )
    return (lambda: plan(full)), (lambda: rp.replan(lean, layout.kv_indptr))


def run(bs: int, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    out = {}
    # (kind, KV heads of 12 query heads): GQA group 3 decodes on CUDA cores, 4 on tensor cores
    for kind, nkv in (("decode_cuda_cores", 4), ("decode_tensor_cores", 3), ("verify", 4)):
        fns = dict(zip(("plan", "lean"), calls_of(kind, bs, nkv), strict=True))
        times: dict[str, list[float]] = {"plan": [], "lean": []}
        for _ in range(rounds):  # alternated: this machine's speed drifts
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append(1e6 * (time.perf_counter() - t0) / calls)
        out[kind] = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--result-file", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"git_commit_of_cwd": git_commit_of_cwd()}
    for bs in a.batch_sizes:
        result[f"bs{bs}"] = run(bs, a.calls, a.rounds)
        print(f"bs {bs}: us per call {result[f'bs{bs}']}")
    if a.result_file:
        cmd = "python benchmark/bench_flashinfer_replan.py " + " ".join(argv or [])
        append_run(a.result_file, cmd.strip(), result)
    return result


if __name__ == "__main__":
    main()
