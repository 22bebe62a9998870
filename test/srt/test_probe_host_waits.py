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
