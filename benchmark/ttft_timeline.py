"""profile_decode_step.py's TTFT rounds (one extra request at a time under a running batch)
and their per-step timeline: what each scheduler step launched, when, and the wall ms of its
phases (build, launch, resolve, commit). Also the MT-Bench prompt ids both use."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from bench_common import REPO, PhaseTimers, sync
from proc_cpu import cpu_share, thread_cpu_seconds
from pyspy_sampling import start_spy, stop_spy


def step_timers(sched) -> PhaseTimers:
    """The scheduler's phases within each step of the TTFT rounds: building the next batch
    (BatchBuilder.get_next_batch_to_run, drains included), launching it and resolving the
    previous one (the overlap client's calls; the worker's call without overlap), committing
    results."""
    client = sched.worker_client
    targets = [(sched.builder, "get_next_batch_to_run", "build")]
    if client is not None:
        targets += [
            (client, "forward_batch_generation_async", "launch"),
            (client, "resolve", "resolve"),
        ]
    else:
        targets.append((sched.tp_worker, "forward_batch_generation", "launch"))
    targets.append((sched.outputs, "process_batch_result", "commit"))
    return PhaseTimers(targets)


def timeline_row(batch, s0: float, t0: float, timers: PhaseTimers) -> dict:
    """One scheduler step of a TTFT round: what it launched, its start and length (ms) and
    its phases (step_timers)."""
    row = {
        "start_ms": round(1e3 * (s0 - t0), 3),
        "ms": round(1e3 * (time.perf_counter() - s0), 3),
        "mode": batch.forward_mode.name if batch is not None else None,
        "bs": len(batch.reqs) if batch is not None else 0,
        "draft_tokens": sum(getattr(r, "draft_len", 0) for r in batch.reqs) if batch else 0,
    }
    row.update(timers.take())
    return row


def mtbench_ids(tokenizer, i: int) -> list[int]:
    """Token ids of MT-Bench question i (cycled) under the tokenizer's chat template."""
    with open(f"{REPO}/benchmark/data/mtbench_questions.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    turn = rows[i % len(rows)]["turns"][0]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def ttft_rounds(sched, a: argparse.Namespace, gen: torch.Generator) -> dict:
    """Server-side TTFT of one extra request at a time under the running batch
    (profile_decode_step.py's --ttft-rounds: see its docstring for the keys); with
    --torch-profile, op tables of the last three rounds; with --cprofile, the scheduler thread's
    profile over the rounds; with --py-spy-ttft, py-spy over them."""
    from sglang.test.scheduler_utils import collect, submit

    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    ms: list[float] = []
    running: list[int] = []  # decoding requests at each round's submission (drafting modes
    # commit up to K + 1 tokens per step and may finish the batch early)
    timeline: list[list[dict]] = []  # per round, per scheduler step (ttft_timeline.py)
    timers = step_timers(sched)
    prof = None
    cprof = cProfile.Profile() if a.cprofile else None
    spy = None
    if a.py_spy_ttft:  # every thread, waiting included, over all the rounds
        raw = (a.result_file or "/tmp/decode_step.json").rsplit(".", 1)[0]
        raw += f"_{a.mode}_ttft_pyspy_idle.txt"
        spy = start_spy(a.py_spy_bin or "py-spy", "idle", raw, sched, a)
    cpu0, wall0 = thread_cpu_seconds(), time.perf_counter()
    for r in range(a.ttft_rounds):
        if a.mtbench:
            ids = mtbench_ids(sched.tokenizer, 1000 + r)
        else:
            ids = torch.randint(100, 30000, (a.input_len,), generator=gen).tolist()
        if a.torch_profile and r == max(0, a.ttft_rounds - 3):
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
            )
            prof.__enter__()
        outputs: dict = {}
        collect(sched, outputs)
        outputs.clear()
        sync(a.device)
        timers.take()  # drop the previous round's tail steps
        t0 = time.perf_counter()
        if cprof is not None:
            cprof.enable()
        running.append(len(sched.running))
        submit(sched, f"t{r}", ids, params, stream=True)
        steps = []
        while not outputs.get(f"t{r}", {}).get("output_ids"):
            s0 = time.perf_counter()
            batch = sched.step()
            collect(sched, outputs)
            steps.append(timeline_row(batch, s0, t0, timers))
        ms.append(1e3 * (time.perf_counter() - t0))
        timeline.append(steps)
        if cprof is not None:
            cprof.disable()
        for _ in range(6):  # let it finish before the next round
            sched.step()
    timers.restore()
    out: dict = {"ttft_ms_median": sorted(ms)[len(ms) // 2], "ttft_ms": ms, "running": running}
    out["ttft_timeline"] = timeline[-4:]
    wall = time.perf_counter() - wall0
    out["ttft_thread_cpu_share"] = cpu_share(cpu0, thread_cpu_seconds(), wall)
    if spy is not None:
        out["ttft_py_spy_idle"] = {"raw_file": raw, **stop_spy(spy, raw)}
    if cprof is not None:  # the scheduler thread over the TTFT rounds
        text = io.StringIO()
        pstats.Stats(cprof, stream=text).sort_stats("cumulative").print_stats(40)
        out["ttft_cprofile_cumulative40"] = text.getvalue().splitlines()
    if prof is not None:
        prof.__exit__(None, None, None)
        ka = prof.key_averages()
        cpu_table = ka.table(sort_by="self_cpu_time_total", row_limit=30)
        out["torch_profile_cpu"] = cpu_table.splitlines()
        if a.device == "cuda":
            out["torch_profile_cuda"] = ka.table(
                sort_by="self_cuda_time_total", row_limit=30
            ).splitlines()
    return out
