"""The per-step timeline of profile_decode_step.py's TTFT rounds: what each scheduler step
launched, when, and the wall ms of its phases (build, launch, resolve, commit)."""

from __future__ import annotations

import time

from bench_common import PhaseTimers


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
