"""FlashInfer paged decode on the GPU: the tensor-core kernel (prefill kernel + merge of split
KV, upstream's choice for GQA groups >= 4) against the CUDA-core decode kernel, device time per
call for a grid of batch sizes and sequence lengths (page size 1, NHD, bf16, Llama-3.1-8B
heads: 32 query heads, 8 KV heads, head_dim 128).

    python benchmark/bench_attention_decode.py [--result-file benchmark/results/...json]

Why: in the 8B batch-1 decode graph the attention of each layer took 9.6 us (prefill kernel)
+ 2.3 us (merge) at ~200 tokens of context (`profile_decode_step.py --kernel-table`), where
one layer's KV is 0.8 MB. Device time is the sum of the kernels' CUDA time over 50 calls
(torch profiler / CUPTI), so launch gaps do not count. Only CUDA.

Also the tensor-core wrapper as the server plans it inside CUDA graphs (`use_cuda_graph=True`:
FlashInfer's planner then always splits KV and runs the merge kernel, and launches its grid
for the largest split) against the same graph wrapper planned with `disable_split_kv=True`
(one CTA per request and KV head walks the whole context, no merge): `graph_split_us` and
`graph_nosplit_us` (with --graph; each planned from host indptrs and replayed from a captured
CUDA graph, as the backend does; the first attempt, running the graph wrappers eagerly from
device indptrs, failed on the H200 with "operation not supported on global/shared address
space"). Whether a batch-1 graph without the split pays at short contexts and what
it costs at long ones decides between one decode graph per batch size and two (short and
long context).

With --triton, our Triton decode kernels on the same KV (the backend's own split rules):
`triton_grouped_us` (one program per request, KV head and split for the whole GQA group,
triton_ops/decode_grouped.py) and `triton_per_head_us` (one program per query head), and,
for each method, `*_layers_us`: wall time per call of a CUDA graph holding --layers calls back
to back (CUDA events around 20 replays), as a model's decode graph runs one per layer, so
launch gaps between a method's kernels count too (FlashInfer: the graph wrapper, planned once).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from bench_common import run_meta, write_json


def kernel_us(fn, calls: int = 50) -> float:
    """Mean summed CUDA kernel time (us) of one fn() call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / calls


def _graph_wrapper(flashinfer, ws: torch.Tensor, bs: int, num_pages: int, dev: str):
    """A tensor-core decode wrapper in CUDA-graph mode (persistent index buffers), as
    FlashInferAttnBackend builds for its graphs."""
    i32 = torch.int32
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=i32, device=dev),
        paged_kv_indices_buffer=torch.zeros(num_pages, dtype=i32, device=dev),
        paged_kv_last_page_len_buffer=torch.ones(bs, dtype=i32, device=dev),
        backend="fa2",
    )


def _capture(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn() captured in a CUDA graph (after one warm-up call on a side stream); returns the
    graph and the output it writes on each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    return graph, out


def _layers_us(fn, layers: int, replays: int = 20) -> float:
    """Wall us per fn() call of a CUDA graph holding `layers` calls of fn, timed with CUDA
    events over `replays` replays (after one warm-up replay)."""
    graph, _ = _capture(lambda: [fn() for _ in range(layers)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * layers)


def _triton_rows(row, outs, q, k, v, indices, bs, seq, layers) -> None:
    """Triton grouped and per-head decode on the benchmark's KV: kernel us, layers us, output."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.attention.triton_ops.decode_attention import (
        alloc_decode_partials,
        decode_attention_fwd,
    )

    nq, nkv, d = q.shape[1], k.shape[1], q.shape[2]
    r2t = indices.view(bs, seq)
    pools = torch.arange(bs, device=q.device)
    lens = torch.full((bs,), seq, device=q.device)
    for grouped in (True, False):
        name = "triton_grouped" if grouped else "triton_per_head"
        backend = TritonAttnBackend(grouped_decode=grouped)
        splits = backend.decode_num_splits(bs, nq, seq, nkv)
        partials = alloc_decode_partials(bs, nq, d, splits, q.device) if splits > 1 else None
        out = torch.empty_like(q)
        fn = partial(
            decode_attention_fwd, q, k, v, out, r2t, pools, lens, d**-0.5,
            num_splits=splits, partials=partials, grouped=grouped,
        )  # fmt: skip
        fn()
        outs[name] = out
        row[f"{name}_splits"] = splits
        row[f"{name}_us"] = kernel_us(fn)
        row[f"{name}_layers_us"] = _layers_us(fn, layers)


def main() -> None:
    import flashinfer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], help="qo kv head_dim")
    p.add_argument("--graph", action="store_true", help="also the CUDA-graph plans")
    p.add_argument("--triton", action="store_true", help="also our Triton decode kernels")
    p.add_argument("--layers", type=int, default=32, help="calls per graph of *_layers_us")
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    nq, nkv, d = a.heads
    dev = "cuda"
    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    rows = []
    for bs in a.batch_sizes:
        for seq in a.seq_lens:
            slots = bs * seq
            k = torch.randn(slots, nkv, d, dtype=torch.bfloat16, device=dev)
            v = torch.randn(slots, nkv, d, dtype=torch.bfloat16, device=dev)
            q = torch.randn(bs, nq, d, dtype=torch.bfloat16, device=dev)
            indptr = torch.arange(0, slots + 1, seq, dtype=torch.int32)
            indices = torch.randperm(slots, dtype=torch.int32).to(dev)  # scattered pages
            last = torch.ones(bs, dtype=torch.int32)
            cache = (k.unsqueeze(1), v.unsqueeze(1))  # [pages, page_size 1, Hkv, D]
            row = {"bs": bs, "seq_len": seq, "kv_mb": 2 * slots * nkv * d * 2 / 1e6}
            outs = {}
            for tc in (True, False):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=tc, backend="fa2"
                )
                w.plan(indptr.to(dev), indices, last.to(dev), nq, nkv, d, 1,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
                outs[tc] = w.run(q, cache)
                row["tensor_cores_us" if tc else "cuda_cores_us"] = kernel_us(
                    partial(w.run, q, cache)
                )
            for nosplit in (False, True) if a.graph else ():
                name = "graph_nosplit" if nosplit else "graph_split"
                w = _graph_wrapper(flashinfer, ws, bs, indices.numel(), dev)
                # planned from host indptrs and replayed from a captured graph, as
                # FlashInferAttnBackend does
                w.plan(indptr, indices, last, nq, nkv, d, 1, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16, disable_split_kv=nosplit)  # fmt: skip
                graph, outs[name] = _capture(partial(w.run, q, cache))
                row[f"{name}_us"] = kernel_us(graph.replay)
                if a.triton:
                    row[f"{name}_layers_us"] = _layers_us(partial(w.run, q, cache), a.layers)
            if a.triton:
                _triton_rows(row, outs, q, k, v, indices, bs, seq, a.layers)
            row["max_abs_diff"] = max(
                (o.float() - outs[True].float()).abs().max().item() for o in outs.values()
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
            del k, v, cache
            torch.cuda.empty_cache()
    if a.result_file:
        write_json(a.result_file, {"meta": run_meta(), "heads": a.heads, "rows": rows})


if __name__ == "__main__":
    main()
