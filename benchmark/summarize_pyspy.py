"""Where a server's scheduler thread spends its samples, from raw py-spy stacks
(`py-spy record --threads --subprocesses -f raw`, as `scripts/gpu_diagnose.sh P` records both
servers of a paired run):

    python benchmark/summarize_pyspy.py serve_pyspy_no_spec.txt serve_pyspy_adaptive.txt \
        --result-file benchmark/results/serve_pyspy_h200_s10.json

Per file: the thread whose stacks contain the scheduler loop (`--anchor`, default
Scheduler.step_overlap) is the scheduler thread; its samples in total, those inside the anchor
(busy) and, for each function of --functions (default: the scheduler's step phases and the
call sites that a decode step's host time went to in the tenth session), the samples whose
stack contains it, as counts and as a share of the busy samples. A sample counts once per
function however often the function appears in its stack. Also the tree of call sites under
the anchor (function@line, --depth levels, nodes with at least --min-samples), and the
thread's samples inside Triton's JIT compiler (`JITFunction._do_compile`: a kernel variant
compiled while serving) by the function that launched the kernel.
"""

from __future__ import annotations

import argparse
import collections
import json

FUNCTIONS = [
    "BatchBuilder.get_next_batch_to_run",
    "BatchBuilder.build_model_worker_batch",
    "TpModelWorkerClient._run",
    "resolve_future_ids",
    "KVPlanner.assign_slots_many",
    "CudaGraphRunner.replay",
    "FlashInferAttnBackend._plan",
    "EAGLEWorkerV2._launch_extend",
    "ModelRunner.forward",
    "Scheduler.commit",
    "SpecScheduler.commit_decode",
    "SpecScheduler.choose_draft_lens",
    "AdaptiveController.observe",
    "OutputProcessor.flush",
]


def load(path: str) -> list[tuple[str, list[str], int]]:
    """(thread id, frames outermost first, samples) per raw line."""
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            parts = stack.split(";")
            i = next((k for k, p in enumerate(parts) if p.startswith("thread (")), None)
            if i is None or not n.isdigit():
                continue
            procs = [p.split(":")[0] for p in parts[:i] if p.startswith("process")]
            rows.append((f"{procs[-1] if procs else ''} {parts[i]}", parts[i + 1 :], int(n)))
    return rows


def summarize(path: str, anchor: str, functions: list[str], depth: int, min_samples: int) -> dict:
    rows = load(path)
    per_thread: collections.Counter = collections.Counter()
    for thread, frames, n in rows:
        if any(f.startswith(anchor + " ") for f in frames):
            per_thread[thread] += n
    if not per_thread:
        return {"file": path, "error": f"no stack contains {anchor}"}
    thread = per_thread.most_common(1)[0][0]
    mine = [(frames, n) for t, frames, n in rows if t == thread]
    total = sum(n for _, n in mine)
    busy = per_thread[thread]
    counts = {}
    for fn in functions:
        c = sum(n for frames, n in mine if any(f.startswith(fn + " ") for f in frames))
        counts[fn] = {"samples": c, "share_of_busy": round(c / max(1, busy), 4)}
    tree: collections.Counter = collections.Counter()
    for frames, n in mine:
        at = next((k for k, f in enumerate(frames) if f.startswith(anchor + " ")), None)
        if at is None:
            continue
        path_ = []
        for f in frames[at + 1 : at + 1 + depth]:
            name, _, where = f.partition(" (")
            path_.append(f"{name}@{where.rstrip(')').rsplit(':', 1)[-1]}")
            tree[" > ".join(path_)] += n
    return {
        "file": path,
        "thread": thread,
        "samples": total,
        "busy_samples": busy,
        "functions": counts,
        "tree": {k: v for k, v in sorted(tree.items()) if v >= min_samples},
        "triton_compiles": triton_compiles(mine),
    }


def triton_compiles(stacks: list[tuple[list[str], int]]) -> dict[str, int]:
    """Samples inside JITFunction._do_compile, by the frame that launched the kernel (the one
    above Triton's `KernelInterface.__getitem__` lambda and `JITFunction.run`)."""
    out: collections.Counter = collections.Counter()
    for frames, n in stacks:
        if not any(f.startswith("JITFunction._do_compile ") for f in frames):
            continue
        run = next((k for k, f in enumerate(frames) if f.startswith("JITFunction.run ")), None)
        if run is None:  # compiled outside a launch (e.g. an explicit warmup)
            continue
        name, _, where = frames[max(0, run - 2)].partition(" (")
        out[f"{name}@{where.rstrip(')').rsplit('/', 1)[-1]}"] += n
    return dict(out.most_common())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--anchor", default="Scheduler.step_overlap")
    p.add_argument("--functions", nargs="+", default=FUNCTIONS)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--min-samples", type=int, default=60)
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    out = {
        "command": "python benchmark/summarize_pyspy.py " + " ".join(a.files),
        "summaries": [summarize(f, a.anchor, a.functions, a.depth, a.min_samples) for f in a.files],
    }
    for s in out["summaries"]:
        print(s["file"], s.get("thread"), "busy", s.get("busy_samples"), "of", s.get("samples"))
        for fn, c in s.get("functions", {}).items():
            print(f"  {fn:40s} {c['samples']:7d} {100 * c['share_of_busy']:6.1f}%")
        for fn, c in s.get("triton_compiles", {}).items():
            print(f"  Triton compile under {fn:26s} {c:7d}")
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
