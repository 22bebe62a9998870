"""Host work of a decode step, counted in torch operator calls (CPU machine, no GPU needed):

    python benchmark/count_step_ops.py [--drafting-k 1 3] [--where] \
        --result-file benchmark/results/step_ops_cpu.json

Why count instead of time: on the H200 host every small torch call costs tens of
microseconds of Python and dispatcher time, and a SmolLM2 decode step is host-bound (the
graph replays in 0.85 ms, a scheduler step takes 1.2 ms or more, and the adaptive server's
steps more still: py-spy of both servers under load, benchmark/README.md, tenth session). The
number of calls per step is what a change removes, and it is exact on any machine; timings
on the CPU machine are not the GPU host's.

What is counted: every aten operator call (a TorchDispatchMode) made by the in-process
Scheduler with overlap scheduling on, on a tiny random model, outside the model itself. The
model's forward (the eager prefill, and the padded static batch the CUDA-graph runner would
replay: the runner runs it eagerly here, use_graphs=False, so the step takes the graph path
of a CUDA server) counts as one call, `model`. Per phase of the step: plan
(get_next_batch_to_run), build (build_model_worker_batch), launch (the worker client's launch
of the step: future-id resolution, the runner's fill of its static inputs, sampling, the
read-back copy), commit (resolve + process_batch_result), flush (outputs to the tokenizer).

Configurations: `plain` (no speculation) and `adaptive_no_drafts` (EAGLE-3, tiny draft,
--speculative-adaptive with a step-time model under which drafting never pays: every step is
a plain decode, the common case under load); with --drafting-k K...: `static_kK` (EAGLE-3 at
a static K: every decode step drafts K tokens per request, then verifies). Per batch size:
steady decode (every request running, ops per step averaged over --steps steps). The draft's
model forward and attention plan count as one call each, like the target's.

Not counted: work done on the CPU outside torch calls (Python, numpy), and what the CUDA path
adds that the CPU path does not have (pinned staging, events, the FlashInfer plan).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from bench_common import (
    append_run,
    git_commit_of_cwd,
    overlap_cpu_scheduler,
    plain_and_adaptive_no_drafts,
    tiny_target_and_draft,
)
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = [
    ("builder", "get_next_batch_to_run", "plan"),
    ("builder", "build_model_worker_batch", "build"),
    ("worker_client", "forward_batch_generation_async", "launch"),
    ("sched", "commit", "commit"),
    ("outputs", "flush", "flush"),
]


class OpCounter(TorchDispatchMode):
    """Counts aten calls per (phase, operator); `paused` > 0 inside the model's forward."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()  # (sglang function, line)
        self.where = where
        self.phase = ["other"]
        self.paused = 0
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not self.paused:
            self.counts[(self.phase[-1], func.overloadpacket.__name__)] += 1
            if self.where:
                self.sites[call_site()] += 1
        return func(*args, **(kwargs or {}))


def call_site() -> str:
    """The innermost sglang frame calling into torch: "module.function:line"."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/sglang/" in name and "/count_step_ops" not in name:
            mod = name.rsplit("/sglang/", 1)[1].removesuffix(".py").replace("/", ".")
            return f"{mod}.{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "?"


def instrument(sched, counter: OpCounter) -> None:
    objs = {
        "builder": sched.builder,
        "worker_client": sched.worker_client,
        "sched": sched,
        "outputs": sched.outputs,
    }
    for owner, name, label in PHASES:
        obj = objs[owner]
        f = getattr(obj, name)

        def phased(*a, _f=f, _label=label, **k):
            counter.phase.append(_label)
            try:
                return _f(*a, **k)
            finally:
                counter.phase.pop()

        setattr(obj, name, phased)

    def as_one_call(obj, name: str, label: str = "model") -> None:
        f = getattr(obj, name)

        def one_call(*a, _f=f, **k):
            if counter.on and not counter.paused:
                counter.counts[(counter.phase[-1], label)] += 1
            counter.paused += 1
            try:
                return _f(*a, **k)
            finally:
                counter.paused -= 1

        setattr(obj, name, one_call)

    worker = sched.tp_worker
    runner = worker.model_runner
    as_one_call(runner.model, "forward")
    if runner.cuda_graph_runner is not None:
        as_one_call(runner.cuda_graph_runner, "_run_model")
    draft = getattr(worker, "draft", None)
    if draft is not None:
        as_one_call(draft.model, "forward")
        as_one_call(draft.attn_backend, "init_forward_metadata", "attn_plan")
    # The eager padded path plans attention with the CPU backend's own metadata; a CUDA
    # server plans FlashInfer / Triton there instead (another cost): one call, `attn_plan`.
    as_one_call(runner.attn_backend, "init_forward_metadata", "attn_plan")


def graph_path(sched, sizes: list[int]) -> None:
    """Give the scheduler's target (and draft) the CUDA-graph runners a CUDA server has, run
    eagerly over their padded static batches (use_graphs=False)."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    worker = sched.tp_worker
    runner = worker.model_runner
    draft = getattr(worker, "draft", None)
    k = sched.server_args.speculative_num_steps or 0
    mode = CaptureHiddenMode.LAST if draft is not None else CaptureHiddenMode.NULL
    runner.cuda_graph_runner = CudaGraphRunner(runner, mode, k + 1, sizes, use_graphs=False)
    if draft is not None:
        draft.init_cuda_graphs(sizes, k + 1, use_graphs=False)


def cuda_like_scheduler(model: str, kw: dict, sizes: list[int]):
    """An in-process Scheduler on the CPU that steps as a CUDA server does: float32, a 65536
    token KV pool, overlap scheduling on, and (graph_path) the CUDA-graph runners for the
    batch-size buckets `sizes`, run eagerly. kw: further ServerArgs fields (speculation)."""
    s = overlap_cpu_scheduler(model, kw)
    graph_path(s, sizes)
    return s


def count(
    model: str, draft: str, bs: int, steps: int, where: bool = False, drafting_ks: tuple = ()
) -> dict:
    from sglang.test.scheduler_utils import run_until_idle, submit

    cfgs = plain_and_adaptive_no_drafts(draft)
    for k in drafting_ks:  # every decode step drafts K tokens per request
        cfgs[f"static_k{k}"] = dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft,
            speculative_num_steps=k,
        )
    params = {"max_new_tokens": steps + 16, "temperature": 0, "ignore_eos": True}
    out = {}
    for name, kw in cfgs.items():
        s = cuda_like_scheduler(model, kw, [1, 2, 4, 8, 16, 32, 64])
        counter = OpCounter(where)
        instrument(s, counter)
        for i in range(bs):
            submit(s, f"r{i}", list(range(10, 40)), params, stream=True)
        with counter:
            while len(s.running) < bs or s.waiting_queue:
                s.step()
            for _ in range(3):
                s.step()
            n0 = s.stats["forward_steps"]
            counter.on = True
            for _ in range(steps):
                s.step()
            counter.on = False
            n = s.stats["forward_steps"] - n0
            run_until_idle(s, {})
            # One more request into the idle scheduler: its prefill step, launch to commit.
            pre = OpCounter(where)
            pre.phase, pre.paused, counter.on = counter.phase, counter.paused, False
            instrument_counts, counter.counts = counter.counts, pre.counts
            sites, counter.sites = counter.sites, pre.sites
            submit(s, "p", list(range(200, 260)), params, stream=True)  # not cached
            counter.on = True
            s.step()
            s.step()
            counter.on = False
            prefill_counts, prefill_sites = counter.counts, counter.sites
            counter.counts, counter.sites = instrument_counts, sites
            run_until_idle(s, {})
        per_phase: dict = collections.defaultdict(float)
        per_op: dict = collections.defaultdict(float)
        for (phase, op), c in counter.counts.items():
            per_phase[phase] += c / n
            per_op[f"{phase}:{op}"] += c / n
        top = sorted(per_op.items(), key=lambda kv: -kv[1])
        out[name] = {
            "ops_per_step": round(sum(per_phase.values()), 2),
            "by_phase": {k: round(v, 2) for k, v in sorted(per_phase.items())},
            "ops": {k: round(v, 2) for k, v in top},
        }
        out[name]["prefill_and_next_step_ops"] = sum(prefill_counts.values())
        if where:
            sites = sorted(counter.sites.items(), key=lambda kv: -kv[1])
            out[name]["sites"] = {k: round(c / n, 2) for k, c in sites}
            sites = sorted(prefill_sites.items(), key=lambda kv: -kv[1])
            out[name]["prefill_sites"] = dict(sites)
        if s.worker_client is not None:
            s.worker_client.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--label", default="current tree")
    p.add_argument("--where", action="store_true", help="also count per sglang call site")
    p.add_argument(
        "--drafting-k",
        type=int,
        nargs="*",
        default=[],
        help="also static EAGLE-3 at these K (every decode step drafts K tokens per request)",
    )
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    model, draft = tiny_target_and_draft()
    result = {"label": a.label, "git_commit_of_cwd": git_commit_of_cwd()}
    for bs in a.batch_sizes:
        result[f"bs{bs}"] = count(model, draft, bs, a.steps, a.where, tuple(a.drafting_k))
        for name, r in result[f"bs{bs}"].items():
            print(f"bs {bs} {name}: {r['ops_per_step']} ops/step {r['by_phase']}")
    if a.result_file:
        append_run(a.result_file, "python benchmark/count_step_ops.py", result)
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
