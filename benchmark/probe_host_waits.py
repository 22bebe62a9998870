"""Which host calls of a decode step wait for the GPU, in-process, on CUDA:

    python benchmark/probe_host_waits.py [--model-path bundled] [--batch-sizes 1 64] \
        [--sleep-ms 5] [--sleep-where after_launch|before_replay] \
        [--result-file benchmark/results/host_waits_h200.json]

Why: through the server the SmolLM2 decode step at concurrency 1 took 1.38 ms on the H200
while its CUDA graph took 0.81 ms, and the scheduler thread's `launch` phase alone (queuing a
step that should never wait) took ~0.93 ms per step (benchmark/README.md, sixteenth
session). Either the host work is that slow or some call in it waits for the step in flight.
Sampling profilers cannot tell a spin-wait from work.

Method, per configuration (`plain`: no speculation; `adaptive`: EAGLE-3 with the bundled
draft and --speculative-adaptive under a step-time model where drafting never pays, so every
step is a plain decode) and batch size, an in-process Scheduler with overlap scheduling
(greedy, ignore_eos, streamed) decodes in steady state, and a set of host calls (TARGETS:
scheduler phases and the calls inside them) are timed on the scheduler thread, in ms per step:

- `base`: --steps ordinary steps;
- `loaded`: the same number of steps with a GPU sleep of --sleep-ms queued on the worker's
  stream right after each launch, or with --sleep-where before_replay right before each graph
  replay, after the attention re-plan's uploads (torch.cuda._sleep, calibrated in the same
  process), so that whatever the host does next happens while the GPU is busy for that long.
  After the launch, the next step's uploads queue behind the sleep: FlashInfer's guard of its
  plan buffer (it waits for the previous plan's upload) then counts as waiting, as on the
  H200 in the seventeenth session; before the replay, it does not;
- `delta` = loaded - base. A call whose delta is near --sleep-ms waits for the device (a
  stream or event synchronisation, a pageable copy, a blocking pinned allocation); one near 0
  does not. `resolve` is expected to wait (that is its job): it waits for the step before the
  sleep, so its delta is ~0 unless the pipeline is more than one step deep.

Also, with torch.cuda.set_sync_debug_mode("warn") over --steps more steps, the syncs that
PyTorch itself reports (item(), pageable copies, synchronize), counted by the innermost
sglang frame that called them (`sync_debug`); and first, `primitives`: the host microseconds
per call of the CUDA calls a launch is made of (pinned allocation and upload, index_put_,
events, a kernel, replays of graphs of 1 and 300 kernels), with the GPU idle and busy.

With --churn LO HI, requests of LO..HI output tokens finish and new ones (random prompts of
--input-len tokens, no shared prefix) take their place before every step (bench_common
.TopUpLoad), so prefill steps run between decode steps with a step in flight, as in serving;
the graphs cover every batch size up to the largest (prefills included, as a server's). Each
run then also splits the scheduler's own phase times (HostPhases: plan, build, launch, commit)
into ms per prefill step and per decode step (`split`), and `prefill_waits` says which phase of
a prefill step grew by the sleep. Why: through the server on the H100 (thirty-eighth session)
an adaptive server's prefill step launched in 1.3-2.2 ms against a plain one's 0.5-0.8 ms at
c = 2, with the same ~55 tokens per prefill step, in 10 rounds of 10, and its TTFT did not
show it in process with long prompts (eager prefills).

On the CPU (no GPU) the script runs the `base` timings only (useful to check it runs).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import time
import traceback
import warnings
from typing import Any

import torch
from bench_common import (
    PhaseTimers,
    TopUpLoad,
    plain_and_adaptive_no_drafts,
    run_meta,
    sync,
    write_json,
)
from cuda_primitives import calibrate_sleep, primitives
from host_phase_deltas import step_kind_seconds

from sglang.srt.managers.host_phases import EXTEND_PHASES

# (path from the Scheduler to an object, or a module's name, method or function name, label).
# Nested labels overlap their enclosing ones on purpose: the innermost label with a delta near
# the sleep names the call. Module functions are timed wherever they are called through the
# module's global (h2d.to_device_async: every pinned upload of int64_to_device).
TARGETS: list[tuple[str, str, str]] = [
    ("builder", "get_next_batch_to_run", "plan"),
    ("kv", "assign_slots_many", "plan.assign_slots_many"),
    ("req_to_token_pool", "write_many", "plan.write_many"),
    ("builder", "build_model_worker_batch", "build"),
    ("worker_client", "forward_batch_generation_async", "launch"),
    ("tp_worker.model_runner", "forward_worker_batch", "launch.forward_worker_batch"),
    ("tp_worker.model_runner.cuda_graph_runner", "_fill", "launch.graph_fill"),
    ("tp_worker.model_runner.cuda_graph_runner", "_execute", "launch.graph_execute"),
    ("tp_worker.model_runner.attn_backend", "_plan", "launch.attn_plan"),
    ("tp_worker.model_runner.attn_backend", "_fill", "launch.attn_fill_kv_indices"),
    ("tp_worker.model_runner.cuda_graph_runner.inputs", "stage", "launch.static_inputs_stage"),
    ("tp_worker.model_runner.cuda_graph_runner.inputs", "upload", "launch.static_inputs_upload"),
    ("sglang.srt.utils.h2d", "to_device_async", "h2d.to_device_async"),  # plan and launch
    ("sglang.srt.managers.pending_result", "copy_to_host_async", "launch.copy_to_host_async"),
    ("worker_client", "resolve", "resolve"),
    ("outputs", "process_batch_result", "commit"),
    ("outputs", "flush", "flush"),
]


def resolve_path(root: Any, path: str) -> Any:
    """root.a.b.c for path "a.b.c", or the module of that name for "sglang...."; None when a
    link is missing or None."""
    if path.startswith("sglang."):
        return importlib.import_module(path)
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def wrap_targets(sched: Any) -> tuple[PhaseTimers, list[str]]:
    """PhaseTimers over every TARGETS entry that exists on this scheduler (a plain server has
    no speculative worker; a CPU one no graph runner). Returns (timers, labels wrapped)."""
    triples, labels = [], []
    for path, method, label in TARGETS:
        obj = resolve_path(sched, path)
        if obj is not None and callable(getattr(obj, method, None)):
            triples.append((obj, method, label))
            labels.append(label)
    return PhaseTimers(triples), labels


def waits(base: dict[str, float], loaded: dict[str, float], sleep_ms: float) -> dict[str, Any]:
    """Per label: delta = loaded - base (ms per step) and `waits` = delta >= sleep_ms / 2.
    base, loaded: label -> ms per step (a label missing from one side counts as 0)."""
    out = {}
    for label in sorted(set(base) | set(loaded)):
        d = loaded.get(label, 0.0) - base.get(label, 0.0)
        out[label] = {"delta_ms": round(d, 4), "waits": d >= sleep_ms / 2}
    return out


def inject_sleep(sched: Any, cycles: int, where: str = "after_launch") -> Any:
    """Make every launch queue a GPU sleep of `cycles` on the worker's stream: after the step
    (`after_launch`), or (`before_replay`) inside a graph launch, after the attention
    backend's re-plan and its uploads and right before the graph replay, as if the graph
    itself ran longer. With `after_launch` the next step's uploads queue behind the sleep, so a
    call that waits for the previous step's upload (FlashInfer's plan buffer guard) counts as
    waiting; with `before_replay` only calls that wait for the step in flight do. Returns a
    function that undoes it."""
    if where == "before_replay":
        backend = sched.tp_worker.model_runner.cuda_graph_runner.backend
        name = "init_forward_metadata_replay_cuda_graph"
        own = backend.__dict__.get(name)  # e.g. a timing wrapper, put back by undo
        plan = getattr(backend, name)

        def plan_then_sleep(*args, **kwargs):
            out = plan(*args, **kwargs)
            torch.cuda._sleep(cycles)  # the current stream: the one the replay runs on
            return out

        setattr(backend, name, plan_then_sleep)
        return lambda: setattr(backend, name, own) if own is not None else delattr(backend, name)
    if where != "after_launch":
        raise ValueError(f"--sleep-where must be after_launch or before_replay, got {where!r}")
    client = sched.worker_client
    real = client.forward_batch_generation_async

    def launch_then_sleep(mwb):
        handle = real(mwb)
        with torch.cuda.stream(client.stream):
            torch.cuda._sleep(cycles)
        return handle

    client.forward_batch_generation_async = launch_then_sleep
    # back to what was there (a timing wrapper of wrap_targets, which restores the method)
    return lambda: setattr(client, "forward_batch_generation_async", real)


def phase_snapshot(sched: Any) -> dict[str, float]:
    """The scheduler's cumulative host phase seconds (HostPhases.info(): `host_s_<phase>` and
    `host_s_<phase>_extend`) with its prefill and forward step counts so far, the keys a
    server's server_state has (host_phase_deltas.step_kind_seconds reads them)."""
    st = sched.stats
    return {
        **sched.phases.info(),
        "prefill_steps": st["prefill_steps"],
        "forward_steps": st["forward_steps"],
    }


def per_step_kind(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """ms per prefill step and per decode step of each of EXTEND_PHASES between two
    phase_snapshot()s (None where no step of that kind ran), and the step counts."""
    prefills, decodes, seconds = step_kind_seconds(before, after, EXTEND_PHASES)
    out: dict[str, Any] = {"prefill_steps": prefills, "decode_steps": decodes}
    for k, (ext, rest) in seconds.items():
        out[f"{k}_ms_per_prefill"] = round(1e3 * ext / prefills, 4) if prefills else None
        out[f"{k}_ms_per_decode"] = round(1e3 * rest / decodes, 4) if decodes else None
    return out


def run_steps(sched: Any, load: TopUpLoad | None, steps: int) -> None:
    """`steps` scheduler steps: topped up by `load` (--churn), else the running batch alone."""
    if load is not None:
        load.run(steps)
        return
    for _ in range(steps):
        sched.step()


def timed_steps(
    sched: Any, timers: PhaseTimers, steps: int, device: str, load: TopUpLoad | None = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """ms per step of each wrapped label over `steps` scheduler steps, and the wall ms; and
    per_step_kind of the same steps."""
    sync(device)
    timers.take()
    before = phase_snapshot(sched)
    t0 = time.perf_counter()
    run_steps(sched, load, steps)
    wall = time.perf_counter() - t0
    out = {k: round(v / steps, 4) for k, v in timers.take().items()}
    out["step_wall"] = round(1e3 * wall / steps, 4)
    return out, per_step_kind(before, phase_snapshot(sched))


def sync_debug_sites(sched: Any, steps: int, load: TopUpLoad | None = None) -> dict[str, int]:
    """Syncs reported by torch.cuda.set_sync_debug_mode("warn") over `steps` steps (topped up
    by `load` when given), counted by the innermost frame under sglang/ (file:line function)
    that made them."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/sglang/" in f.filename]
        where = f"{filename}:{lineno}"
        if frames:
            f = frames[-1]
            where = f"{f.filename.split('/sglang/')[-1]}:{f.lineno} {f.name}"
        sites[f"{where}: {str(message)[:80]}"] += 1

    with warnings.catch_warnings():  # restores warnings.showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_steps(sched, load, steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites.most_common())


def probe(model: str | None, kw: dict, bs: int, a: argparse.Namespace) -> dict[str, Any]:
    """One configuration at batch size bs: base (and on CUDA loaded, delta, sync_debug); with
    a.churn, requests finish and join every few steps, and each run's per_step_kind split
    (`split`) comes too, with `prefill_waits` on CUDA."""
    from sglang.test.scheduler_utils import make_scheduler, submit

    churn = getattr(a, "churn", None)
    # graphs up to 4 x bs under churn: the H100 run of the thirty-eighth session had its
    # load overshoot to 2 x bs (TopUpLoad then missed requests whose prefill was in flight,
    # fixed since) and its decode steps past the graphs ran eagerly
    graphs = {"cuda_graph_max_bs": 4 * bs} if churn else {"cuda_graph_bs": [bs]}
    sched = make_scheduler(
        model,
        device=a.device,
        dtype=a.dtype,
        max_total_tokens=a.max_total_tokens,
        disable_overlap_schedule=False,  # the CPU too: the same scheduler loop
        attention_backend=getattr(a, "attention_backend", None),
        **graphs,
        **kw,
    )
    if not sched.enable_overlap:
        raise RuntimeError("the probe needs overlap scheduling (the CUDA default)")
    load = None
    if churn:
        load = TopUpLoad(sched, bs, seed=0, out_lens=tuple(churn), input_len=a.input_len)
        load.run(4 * churn[1])  # every bucket the load reaches is warm
    else:
        params = {"max_new_tokens": 4 * a.steps + 64, "temperature": 0, "ignore_eos": True}
        gen = torch.Generator().manual_seed(0)
        for i in range(bs):
            ids = torch.randint(100, 30000, (a.input_len,), generator=gen).tolist()
            submit(sched, f"r{i}", ids, params, stream=True)
        for _ in range(16):  # prefills, then steady decode
            sched.step()
    timers, labels = wrap_targets(sched)
    out: dict[str, Any] = {"labels": labels}
    out["base"], split = timed_steps(sched, timers, a.steps, a.device, load)
    if churn:
        out["split"] = {"base": split}
    if a.device == "cuda":
        cycles = int(a.sleep_ms * calibrate_sleep(a.device))
        undo = inject_sleep(sched, cycles, a.sleep_where)
        out["loaded"], split = timed_steps(sched, timers, a.steps, a.device, load)
        undo()
        out["delta"] = waits(out["base"], out["loaded"], a.sleep_ms)
        if churn:
            out["split"]["loaded"] = split
            out["prefill_waits"] = prefill_waits(out["split"], a.sleep_ms)
        out["sync_debug"] = sync_debug_sites(sched, a.steps, load)
    timers.restore()
    if sched.worker_client is not None:
        sched.worker_client.shutdown()
    return out


def prefill_waits(split: dict[str, dict[str, Any]], sleep_ms: float) -> dict[str, Any]:
    """waits() of each phase's ms per prefill step, base against loaded (a phase missing or
    None on one side counts as 0)."""
    per = {
        side: {
            k.removesuffix("_ms_per_prefill"): v or 0.0
            for k, v in split[side].items()
            if k.endswith("_ms_per_prefill")
        }
        for side in ("base", "loaded")
    }
    return waits(per["base"], per["loaded"], sleep_ms)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default (or 'bundled'): SmolLM2-135M")
    p.add_argument("--draft-path", default=None, help="EAGLE-3 draft (default: the bundled one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--configs", nargs="+", default=["plain", "adaptive"])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    p.add_argument(
        "--sleep-where",
        choices=["after_launch", "before_replay"],
        default="after_launch",
        help="where the GPU sleep is queued (see inject_sleep)",
    )
    p.add_argument(
        "--churn",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="requests of LO..HI output tokens, topped up every step (prefills between decodes)",
    )
    p.add_argument("--attention-backend", default=None, help="default: the server's default")
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--result-file", default=None)
    a = p.parse_args(argv)
    if a.churn is not None and not 1 <= a.churn[0] <= a.churn[1]:
        p.error(f"--churn needs 1 <= LO <= HI, got {a.churn[0]} {a.churn[1]}")
    if a.churn is not None and a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    torch.set_grad_enabled(False)
    model = None if a.model_path in (None, "bundled") else a.model_path
    if a.dtype is None:
        a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    draft = a.draft_path
    if draft is None:
        from sglang.srt.speculative.bundled_draft import bundled_draft_path

        draft = bundled_draft_path()
    kws = plain_and_adaptive_no_drafts(draft)
    kws["adaptive"] = kws.pop("adaptive_no_drafts")
    # what `--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-adaptive`
    # serves with (the sweeps' `adaptive`): the default policy, its warm-up sweep on CUDA
    kws["adaptive_server"] = dict(
        kws["adaptive"], speculative_num_steps=5, speculative_adaptive_config=None
    )
    bad = [c for c in a.configs if c not in kws]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {sorted(kws)}")
    result: dict[str, Any] = {"meta": run_meta(argv), "settings": vars(a), "probes": {}}
    if a.device == "cuda":
        result["primitives"] = primitives(a.sleep_ms)
        for name, v in result["primitives"].items():
            print(f"{name:28s} {v}")
    for name in a.configs:
        for bs in a.batch_sizes:
            key = f"{name}_bs{bs}"
            result["probes"][key] = probe(model, kws[name], bs, a)
            got = result["probes"][key]
            print(key, got.get("delta", got["base"]))
            for side, split in got.get("split", {}).items():
                print(f"  {side}: {split}")
            if "prefill_waits" in got:
                print(f"  prefill_waits: {got['prefill_waits']}")
            if a.result_file:
                write_json(a.result_file, result)
    return result


if __name__ == "__main__":
    main()
