"""benchmark/probe_host_waits.py: the wait verdict from base and loaded timings, and the CPU
path of a probe (the timed calls found on a plain and an adaptive scheduler; no GPU sleep)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))

from bench_common import plain_and_adaptive_no_drafts  # noqa: E402
from probe_host_waits import inject_sleep, probe, waits  # noqa: E402


def test_a_call_waits_when_its_delta_reaches_half_the_sleep():
    base = {"plan": 0.2, "launch": 0.9, "commit": 0.1}
    loaded = {"plan": 0.25, "launch": 5.6, "flush": 3.0}
    got = waits(base, loaded, sleep_ms=5.0)
    assert got["launch"] == {"delta_ms": 4.7, "waits": True}
    assert got["plan"] == {"delta_ms": 0.05, "waits": False}
    assert got["commit"] == {"delta_ms": -0.1, "waits": False}  # missing when loaded: 0
    assert got["flush"] == {"delta_ms": 3.0, "waits": True}  # 3.0 >= 2.5


def _args(steps: int) -> argparse.Namespace:
    return argparse.Namespace(
        device="cpu", dtype="float32", max_total_tokens=4096, steps=steps, input_len=12,
        sleep_ms=5.0,
    )  # fmt: skip


def test_cpu_probe_times_the_scheduler_phases(tiny_model_dir, draft_dir):
    from sglang.srt.utils import h2d

    original = h2d.to_device_async
    kws = plain_and_adaptive_no_drafts(draft_dir)
    for name in ("plain", "adaptive_no_drafts"):
        out = probe(tiny_model_dir, kws[name], bs=3, a=_args(steps=6))
        wrapped = set(out["labels"])
        assert {"plan", "plan.write_many", "build", "launch", "resolve", "commit", "flush"} <= (
            wrapped
        )
        assert not any(label.startswith("launch.graph") for label in wrapped)  # no graphs on CPU
        base = out["base"]
        # every step plans, builds, launches, resolves, commits and flushes once
        assert all(base[k] > 0 for k in ("plan", "build", "launch", "resolve", "commit", "flush"))
        assert base["plan.write_many"] <= base["plan"]
        assert base["launch"] + base["plan"] <= base["step_wall"]
        assert "loaded" not in out and "delta" not in out  # the GPU sleep needs CUDA
        # a module function timed through its global is put back afterwards
        assert "h2d.to_device_async" in wrapped and h2d.to_device_async is original


def test_sleep_before_replay_follows_the_re_plan_and_is_undone(monkeypatch):
    """--sleep-where before_replay queues the sleep after the graph backend's re-plan (its
    uploads) and before the replay, and undo puts back what was there (a timing wrapper)."""
    from types import SimpleNamespace

    import torch

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(f"sleep {cycles}"))

    class Backend:
        def init_forward_metadata_replay_cuda_graph(self, fb, n):
            calls.append(f"plan {fb} {n}")

    backend = Backend()
    timing = backend.init_forward_metadata_replay_cuda_graph  # an own attribute, as a timer's
    backend.init_forward_metadata_replay_cuda_graph = timing
    runner = SimpleNamespace(cuda_graph_runner=SimpleNamespace(backend=backend))
    sched = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))
    undo = inject_sleep(sched, 7, "before_replay")
    backend.init_forward_metadata_replay_cuda_graph("fb", 3)
    assert calls == ["plan fb 3", "sleep 7"]
    undo()
    assert backend.init_forward_metadata_replay_cuda_graph is timing
    with pytest.raises(ValueError, match="before_replay"):
        inject_sleep(sched, 7, "elsewhere")


def test_per_step_kind_splits_each_phase_into_prefill_and_decode_steps():
    from probe_host_waits import per_step_kind, prefill_waits

    phases = ("plan", "build", "launch", "commit")

    def state(total: dict, extend: dict, prefills: int, forward: int) -> dict:
        """phase_snapshot()'s keys (HostPhases.info() and the step counts)."""
        out = {f"host_s_{k}": v for k, v in total.items()}
        out.update({f"host_s_{k}_extend": v for k, v in extend.items()})
        return out | {"prefill_steps": prefills, "forward_steps": forward}

    before = state(dict.fromkeys(phases, 1.0), dict.fromkeys(phases, 0.5), 3, 10)
    after_s = {"plan": 1.030, "build": 1.010, "launch": 1.100, "commit": 1.004}
    after_e = {"plan": 0.506, "build": 0.502, "launch": 0.540, "commit": 0.500}
    got = per_step_kind(before, state(after_s, after_e, 7, 30))  # 4 prefill, 16 decode steps
    assert got["prefill_steps"] == 4 and got["decode_steps"] == 16
    assert got["launch_ms_per_prefill"] == pytest.approx(10.0)  # 40 ms over 4
    assert got["launch_ms_per_decode"] == pytest.approx(3.75)  # (100 - 40) ms over 16
    assert got["plan_ms_per_prefill"] == pytest.approx(1.5)
    assert got["commit_ms_per_decode"] == pytest.approx(0.25)
    none = per_step_kind(before, state(after_s, after_e, 3, 30))  # no prefill step between
    assert none["launch_ms_per_prefill"] is None and none["decode_steps"] == 20
    split = {"base": got, "loaded": dict(got, launch_ms_per_prefill=14.0, plan_ms_per_prefill=None)}
    w = prefill_waits(split, sleep_ms=5.0)
    assert w["launch"] == {"delta_ms": 4.0, "waits": True}
    assert w["plan"] == {"delta_ms": -1.5, "waits": False}  # None counts as 0
    assert w["build"]["delta_ms"] == 0.0


def test_top_up_load_random_prompts_keep_the_fixed_prompt_runs_output_lengths(monkeypatch):
    """input_len draws distinct prompts of that length; without it the prompt is ids 10..39
    and the output lengths are the same draws as before (the committed results' load)."""
    from types import SimpleNamespace

    import numpy as np
    from bench_common import TopUpLoad

    import sglang.test.scheduler_utils as su

    got: list = []

    def submit(s, rid, ids, params, stream=False):
        got.append((ids, params))
        s.waiting_queue.append(SimpleNamespace(finished=lambda: False))

    monkeypatch.setattr(su, "submit", submit)
    for input_len in (None, 16):
        got.clear()
        sched = SimpleNamespace(running=[], waiting_queue=[])
        sched.step = sched.waiting_queue.clear  # every request leaves within its step
        TopUpLoad(sched, bs=3, seed=5, out_lens=(4, 9), input_len=input_len).run(2)
        assert len(got) == 6  # topped up to 3 before each of the 2 steps
        lens = [p["max_new_tokens"] for _, p in got]
        if input_len is None:
            rng = np.random.default_rng(5)
            assert lens == [int(rng.integers(4, 10)) for _ in range(6)]
            assert all(ids == list(range(10, 40)) for ids, _ in got)
        else:
            assert all(len(ids) == 16 and min(ids) >= 100 and max(ids) < 30000 for ids, _ in got)
            assert len({tuple(ids) for ids, _ in got}) == 6
            assert all(4 <= n <= 9 for n in lens)


def test_cpu_churn_probe_splits_prefill_and_decode_steps(tiny_model_dir, draft_dir):
    """--churn: requests finish and join, so both kinds of step run inside the timed steps,
    and each kind's phases are split out of the scheduler's own phase times."""
    kws = plain_and_adaptive_no_drafts(draft_dir)
    a = _args(steps=24)
    a.churn = [2, 5]
    for name in ("plain", "adaptive_no_drafts"):
        out = probe(tiny_model_dir, kws[name], bs=3, a=a)
        split = out["split"]["base"]
        assert split["prefill_steps"] >= 3 and split["decode_steps"] >= 3
        # at most one launch per scheduler step (a step may launch nothing, e.g. when every
        # running request's in-flight token is its last)
        assert split["prefill_steps"] + split["decode_steps"] <= 24
        for phase in ("plan", "build", "launch", "commit"):
            assert split[f"{phase}_ms_per_prefill"] > 0 and split[f"{phase}_ms_per_decode"] > 0
        assert "prefill_waits" not in out and "loaded" not in out["split"]


def test_top_up_load_stops_when_the_scheduler_rejects_its_requests(tiny_model_dir):
    """A request the scheduler ends at submit (here: a prompt longer than the context) never
    counts as in the system; topping up would submit forever, so the load raises instead."""
    from bench_common import TopUpLoad

    from sglang.test.scheduler_utils import make_scheduler

    sched = make_scheduler(
        tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=1024, context_length=64
    )
    with pytest.raises(RuntimeError, match="rejected request r0 at submit"):
        TopUpLoad(sched, bs=2, out_lens=(4, 8), input_len=80).run(1)
