"""Where a batch-B decode step's time goes on the GPU: the scheduler's whole step against the
replay of its CUDA graph alone, with and without overlap scheduling.

    python benchmark/profile_decode_step.py [--model-path benchmark/configs/llama31_8b_dummy \
        --load-format dummy --dtype bfloat16] [--batch-size 1] [--steps 64] \
        [--result-file benchmark/results/decode_step_h200.json]

Per mode (`overlap`: the default CUDA scheduler loop, steps queued ahead of the GPU; `sync`:
--disable-overlap-schedule, each step waits for its tokens; `adaptive`: overlap with EAGLE-3
(--draft-path, default the bundled draft) and --speculative-adaptive; `static_sync`: the same
draft at a static K = --spec-k with overlap off, so that --cprofile sees the whole speculative
step on the scheduler thread; `adaptive_sync`: adaptive with overlap off), in a fresh process:
an in-process Scheduler (no HTTP, no tokenizer process) decodes --batch-size requests (random
prompt ids, greedy, ignore_eos) and reports

- prefill_ms: wall time of the prefill of the batch's prompts (all submitted at once, every
  step until the waiting queue is empty, the last one committed; includes the speculative
  draft extend), the first prefill of the process (no warm-up);
- ttft_ms (--ttft-rounds N): N times, one more request (a fresh prompt of the same kind) is
  submitted while the batch decodes; wall time from its submission until its first token is
  committed (scheduler steps in a loop; CUDA synchronised at the start), i.e. the server-side
  TTFT under a running batch of --batch-size; median and all rounds; ttft_timeline: the
  last four rounds step by step (what each scheduler step launched, its start and wall ms,
  and the ms of its phases: build, launch, resolve, commit). With --torch-profile, the
  torch profiler's top CPU and CUDA ops over the last three rounds;
- step_ms: wall time per scheduler step over --steps decode steps (CUDA synchronised at both
  ends), i.e. what one token of each request costs end to end inside the scheduler;
  step_ms_by_chunk: the same per --chunk-steps consecutive steps (drift within the window);
  stale_draft_reqs (speculative modes): running requests that can no longer draft (their
  pending hidden states exceeded the cap);
- waits_per_step: this process's page faults and context switches, the decode thread's
  run-queue delay and the host's steal time per step over the same window (proc_cpu.
  waits_snapshot): what slows a process whose host phases all run slower at once;
- graph_ms: one replay of the same step's CUDA graph alone (same inputs, --steps replays);
- host_overhead_ms = step_ms - graph_ms: time the GPU is not running the model's graph;
- speculative modes: the scheduler's speculative counters (drafting steps, accepted drafts)
  and, for `adaptive`, its fitted step-time coefficients and (--controller-trace) the
  controller's per-step debug lines (predicted / measured step time);
- with --weight-bytes (config arithmetic of bench_common.llama_weight_bytes) and the copy
  bandwidth measured in the same process: roofline_ms and roofline_fraction = roofline_ms /
  step_ms;
- --kernel-table: the CUDA kernels of 8 replays of the step's graph (CUPTI), by total time;
- --py-spy-steps N (py-spy on PATH or --py-spy-bin): py-spy attached to this process while
  the scheduler runs N more decode steps, once sampling only the GIL holder and once every
  thread; per thread the top leaf frames in the JSON, raw stacks next to --result-file;
  --py-spy-ttft: the same (every thread, waiting included) over the TTFT rounds.

Only CUDA: the point is device idle time. Results are written as JSON (rewritten per mode).
The TTFT rounds live in ttft_timeline.py, the torch.profiler helpers (--kernel-table,
--step-profile) in step_profiles.py, py-spy in pyspy_sampling.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import subprocess
import sys
import time

import torch
from bench_common import (
    REPO,
    llama_weight_bytes,
    measure_copy_bandwidth,
    run_meta,
    sync,
    write_json,
)
from proc_cpu import cpu_share, thread_cpu_seconds, waits_per_step, waits_snapshot
from pyspy_sampling import py_spy_window
from step_profiles import chunk_means, kernel_table, step_profile
from ttft_timeline import mtbench_ids, ttft_rounds

DEFAULT_MODEL = f"{REPO}/benchmark/configs/llama31_8b_dummy"


def one_mode(a: argparse.Namespace) -> dict:
    from sglang.srt.utils.process import apply_gil_switch_interval
    from sglang.test.scheduler_utils import make_scheduler, submit

    torch.set_grad_enabled(False)
    switch_s = apply_gil_switch_interval()  # SGLANG_GIL_SWITCH_INTERVAL_MS, as a server's
    spec = {}
    trace: list[str] = []
    # EAGLE-3 (the bundled draft unless --draft-path)
    if a.mode in ("adaptive", "adaptive_sync", "static_sync"):
        spec = dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=a.draft_path,
            speculative_num_steps=a.spec_k if a.mode == "static_sync" else 5,
            speculative_adaptive=a.mode != "static_sync",
        )
        if a.controller_trace:  # the per-step debug line costs ~0.1 ms of host per step
            log = logging.getLogger("sglang.srt.speculative.adaptive.controller")
            log.setLevel(logging.DEBUG)
            log.addHandler(_ListHandler(trace))
    sched = make_scheduler(
        a.model_path,  # None: the bundled SmolLM2-135M-Instruct
        load_format=a.load_format,
        dtype=a.dtype,
        device=a.device,
        max_total_tokens=a.max_total_tokens,
        cuda_graph_bs=[a.batch_size, a.batch_size + 1],  # + 1: the TTFT rounds' extra request
        cuda_graph_prefill_max_tokens=a.cuda_graph_prefill_max_tokens,
        disable_overlap_schedule=a.mode in ("sync", "static_sync", "adaptive_sync"),
        attention_backend=a.attention_backend,
        **spec,
    )
    warm = 8
    budget = warm + a.steps + 16 + 8 * a.ttft_rounds + a.py_spy_steps + a.step_profile
    budget += 2 * 1000 if a.py_spy_steps or a.py_spy_ttft else 0  # py-spy attach: 1 s of steps
    # a drafting step commits up to K + 1 tokens: every timed step must still have its requests
    budget *= 1 + (spec["speculative_num_steps"] if spec else 0)
    params = {"max_new_tokens": budget, "temperature": 0, "ignore_eos": True}
    gen = torch.Generator().manual_seed(0)
    for i in range(a.batch_size):
        if a.mtbench:  # real text under the chat template (draft acceptance as in serving)
            ids = mtbench_ids(sched.tokenizer, i)
        else:
            ids = torch.randint(100, 30000, (a.input_len,), generator=gen).tolist()
        submit(sched, f"r{i}", ids, params)
    sync(a.device)
    t0 = time.perf_counter()
    while sched.waiting_queue or sched.chunked_req:
        sched.step()
    if sched.enable_overlap:
        sched.drain()
    sync(a.device)
    prefill_ms = 1e3 * (time.perf_counter() - t0)  # the batch's prompts, admitted at once
    for _ in range(warm):
        sched.step()
    sync(a.device)
    prof = cProfile.Profile() if a.cprofile else None
    phases0 = dict(sched.phases.seconds)
    cpu0 = thread_cpu_seconds()
    waits0 = waits_snapshot()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    marks = []  # perf_counter after each step (no sync: queued steps land in later ones)
    for _ in range(a.steps):
        sched.step()
        marks.append(time.perf_counter())
    sync(a.device)
    wall = time.perf_counter() - t0
    step_ms = 1e3 * wall / a.steps
    out = {"mode": a.mode, "batch_size": a.batch_size, "step_ms": step_ms, "prefill_ms": prefill_ms}
    # the scheduler's host phases per step, as a server reports them (host_us_per_step of
    # paired_serving.py): the in-process side of a server-vs-in-process comparison
    out["host_us_per_step"] = {
        k: round(1e6 * (v - phases0[k]) / a.steps, 1) for k, v in sched.phases.seconds.items()
    }
    out["step_ms_by_chunk"] = chunk_means(t0, marks, a.chunk_steps)
    if sched.spec is not None:  # requests whose pending draft states were dropped for good
        out["stale_draft_reqs"] = sum(r.draft.stale for r in sched.running)
    out["gil_switch_interval_s"] = switch_s
    client = sched.worker_client
    if client is not None:  # SGLANG_OVERLAP_THREAD: where steps launch
        out["overlap_launch_thread"] = "scheduler" if client.thread is None else "worker"
    out["decode_thread_cpu_share"] = cpu_share(cpu0, thread_cpu_seconds(), wall)
    # page faults, context switches, run-queue delay and host steal per step (proc_cpu): what
    # slows a process whose host phases all run slower without more work of its own
    out["waits_per_step"] = waits_per_step(waits0, waits_snapshot(), a.steps)
    if prof is not None:  # the scheduler thread only (the worker thread is not profiled)
        prof.disable()
        if a.cprofile_dir:  # the whole table, for a function-by-function diff of two modes
            os.makedirs(a.cprofile_dir, exist_ok=True)
            prof.dump_stats(os.path.join(a.cprofile_dir, f"{a.mode}_{os.getpid()}.prof"))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        out["scheduler_thread_cprofile_top30"] = text.getvalue().splitlines()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        out["scheduler_thread_cprofile_cumulative45"] = text.getvalue().splitlines()
        out["note"] = "step_ms is inflated by cProfile in this run"
    if a.step_profile:
        out["step_profile"] = step_profile(sched, a)
    if a.py_spy_steps:
        out.update(py_spy_window(sched, a))
    if a.ttft_rounds:
        out.update(ttft_rounds(sched, a, gen))
    runner = sched.tp_worker.model_runner.cuda_graph_runner
    if runner is not None:
        key = runner.pick(a.batch_size, a.batch_size)
        graph = runner.graphs[key]
        sync(a.device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            graph.replay()
        sync(a.device)
        out["graph_ms"] = 1e3 * (time.perf_counter() - t0) / a.steps
        out["host_overhead_ms"] = step_ms - out["graph_ms"]
        if runner.max_extend_len > 1:  # a speculative runner: its verify graph of K + 1 tokens
            vkey = runner.pick(a.batch_size, a.batch_size * runner.max_extend_len)
            sync(a.device)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                runner.graphs[vkey].replay()
            sync(a.device)
            out["verify_graph_ms"] = 1e3 * (time.perf_counter() - t0) / a.steps
        if a.kernel_table:  # the graphs' kernels (CUPTI traces kernels of graph launches)
            out["graph_kernel_table"] = kernel_table(graph, a.device)
            if runner.max_extend_len > 1:
                out["verify_graph_kernel_table"] = kernel_table(runner.graphs[vkey], a.device)
    out["scheduler_stats"] = {
        k: v for k, v in sched.stats.items() if k.startswith(("forward", "overlap"))
    }
    if sched.spec is not None:
        out["spec"] = sched.spec.server_info()
        out["controller_trace"] = trace[-160:]
    if sched.worker_client is not None:
        sched.worker_client.shutdown()
    return out


class _ListHandler(logging.Handler):
    """Keeps the formatted records (the adaptive controller's per-step debug lines)."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL, help="'bundled': SmolLM2-135M")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--chunk-steps", type=int, default=32, help="steps per step_ms_by_chunk entry")
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument(
        "--modes",
        nargs="+",
        default=["overlap", "sync"],
        help="overlap sync adaptive adaptive_sync static_sync; a mode given again runs again "
        "in its own process (e.g. overlap adaptive adaptive overlap: ABBA order, since the "
        "host's speed drifts within a call), its results under <mode>_2, <mode>_3, ...",
    )
    p.add_argument("--device", default="cuda", help="cpu: only to check the script")
    p.add_argument("--mtbench", action="store_true", help="MT-Bench prompts, not random ids")
    p.add_argument("--spec-k", type=int, default=1, help="K of mode static_sync")
    p.add_argument("--draft-path", default=None, help="EAGLE-3 draft of mode adaptive")
    p.add_argument("--cprofile", action="store_true", help="profile the scheduler thread")
    p.add_argument(
        "--cprofile-dir",
        default=None,
        help="with --cprofile: also dump each mode's pstats as DIR/<mode>_<pid>.prof",
    )
    p.add_argument("--ttft-rounds", type=int, default=0, help="TTFT of N extra requests")
    p.add_argument("--torch-profile", action="store_true", help="op tables of 3 TTFT rounds")
    p.add_argument("--kernel-table", action="store_true", help="CUDA kernels of 8 replays")
    p.add_argument("--step-profile", type=int, default=0, help="torch.profiler over N steps")
    p.add_argument(
        "--trace-file", default=None, help="--step-profile's chrome trace: PATH_<mode>.json"
    )
    p.add_argument(
        "--controller-trace",
        action="store_true",
        help="keep the adaptive controller's per-step debug lines (adds host work per step)",
    )
    p.add_argument("--py-spy-steps", type=int, default=0, help="decode steps sampled by py-spy")
    p.add_argument("--py-spy-bin", default=None, help="py-spy executable (default: on PATH)")
    p.add_argument(
        "--py-spy-ttft", action="store_true", help="py-spy --idle over the --ttft-rounds"
    )
    p.add_argument(
        "--default-cpu-pools",
        action="store_true",
        help="keep OpenMP/OpenBLAS/MKL at one thread per core (a server's scheduler uses one)",
    )
    p.add_argument(
        "--cuda-graph-prefill-max-tokens",
        type=int,
        default=None,
        help="the server flag: prefill graphs up to this many tokens (0: off; default: the "
        "server's), in the captured batch sizes up to --cuda-graph-prefill-max-bs (default 8); "
        "graphs start at bs 1 only when --batch-size is 1",
    )
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--result-file", default=None)
    p.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode, print JSON
    a = p.parse_args()
    if a.cprofile_dir and not a.cprofile:
        p.error("--cprofile-dir needs --cprofile")
    if a.model_path == "bundled":
        a.model_path, a.load_format = None, "auto"
    if a.device.startswith("cuda") and not torch.cuda.is_available():  # else a torch assert
        p.error("needs a CUDA device (torch sees none); --device cpu only checks the script")
    spec_modes = {"adaptive", "adaptive_sync", "static_sync"} & set(a.modes)
    if spec_modes and a.draft_path and not os.path.isdir(a.draft_path):
        # else the modes before the first speculative one run, and then it fails
        p.error(
            f"--draft-path {a.draft_path} (modes {sorted(spec_modes)}) does not exist; for the "
            "dummy 8B pair: python benchmark/make_dummy_eagle3_draft.py --config-dir "
            "benchmark/configs/llama31_8b_eagle3_dummy --out /tmp/llama31_8b_eagle3_dummy "
            "--device cuda"
        )
    if a.mode:
        print("RESULT " + json.dumps(one_mode(a)), flush=True)
        return
    result: dict = {"meta": run_meta(sys.argv), "settings": vars(a), "modes": {}}
    from sglang.srt.model_loader.loader import resolve_model_path
    from sglang.srt.utils.process import scheduler_heap_env, scheduler_thread_env

    with open(f"{resolve_model_path(a.model_path)}/config.json") as f:
        weight_bytes = llama_weight_bytes(json.load(f), 2 if "16" in a.dtype else 4)["total"]
    bw = measure_copy_bandwidth(int(a.copy_gib * 2**30), a.device)
    result["weight_bytes"] = weight_bytes
    result["bandwidth"] = bw
    roofline_ms = 1e3 * weight_bytes / (bw["bandwidth_gb_s"] * 1e9)
    result["roofline_ms"] = roofline_ms
    seen: dict[str, int] = {}
    for mode in a.modes:
        seen[mode] = seen.get(mode, 0) + 1
        name = mode if seen[mode] == 1 else f"{mode}_{seen[mode]}"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        env = dict(os.environ)  # the CPU thread pools and heap of a server's scheduler process
        env.update(scheduler_thread_env(a.device) if not a.default_cpu_pools else {})
        env.update(scheduler_heap_env())  # SGLANG_SCHEDULER_HUGEPAGE_HEAP, as a server
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            result["modes"][name] = {"error": proc.stderr[-3000:]}
        else:
            r = json.loads(lines[-1][len("RESULT ") :])
            r["roofline_fraction"] = roofline_ms / r["step_ms"]
            if "graph_ms" in r:
                r["graph_roofline_fraction"] = roofline_ms / r["graph_ms"]
            result["modes"][name] = r
        print(json.dumps(result["modes"][name], indent=1), flush=True)
        if a.result_file:
            write_json(a.result_file, result)


if __name__ == "__main__":
    main()
