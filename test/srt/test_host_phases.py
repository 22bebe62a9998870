"""The scheduler's host-phase seconds (managers/host_phases.py): each phase counted once, a
nested phase taken out of the enclosing one, and the server-info keys of a real scheduler."""

from __future__ import annotations

import time

import pytest

from sglang.srt.managers import host_phases
from sglang.srt.managers.host_phases import EXTEND_PHASES, HOST_PHASES, HostPhases
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_chain_and_nested_time_leaves_the_enclosing_phase(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(host_phases.time, "perf_counter", clock)
    ph = HostPhases()
    t = ph.mark()
    clock.now += 0.5  # plan work
    inner = ph.mark()  # a drain inside plan: resolve 2.0 s, commit 0.25 s, flush 0.125 s
    clock.now += 2.0
    inner = ph.add_nested("resolve", inner)
    clock.now += 0.25
    ph.add_nested("commit", inner)
    inner = ph.mark()
    clock.now += 0.125
    ph.add_nested("flush", inner)
    clock.now += 0.5  # more plan work
    t = ph.add("plan", t)
    clock.now += 1.0
    t = ph.add("build", t)
    clock.now += 0.25
    ph.add("flush", t)
    assert ph.seconds == {
        "recv": 0.0,
        "plan": 1.0,
        "build": 1.0,
        "launch": 0.0,
        "resolve": 2.0,
        "commit": 0.25,
        "flush": 0.375,
    }
    assert sum(ph.seconds.values()) == clock.now - 100.0  # every second counted once
    assert set(ph.info()) == {f"host_s_{k}" for k in HOST_PHASES} | {
        f"host_s_{k}_extend" for k in EXTEND_PHASES
    }
    assert not any(ph.extend_seconds.values())
    with pytest.raises(KeyError):
        ph.add("sleep", ph.mark())
    # a prefill step's time goes to the phase and to its prefill part; a nested commit too
    t = ph.mark()
    clock.now += 0.5
    t = ph.add("launch", t, extend=True)
    clock.now += 0.25
    ph.add_nested("commit", t, extend=True)
    assert ph.seconds["launch"] == 0.5 and ph.seconds["commit"] == 0.5
    assert ph.extend_seconds == {"plan": 0.0, "build": 0.0, "launch": 0.5, "commit": 0.25}
    assert ph.info()["host_s_launch_extend"] == 0.5
    with pytest.raises(KeyError):
        ph.add("flush", ph.mark(), extend=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_reports_its_phases(tiny_model_dir, overlap) -> None:
    """Through a real (CPU) scheduler: every phase a step runs is positive, `resolve` only
    with overlap, and the phases sum to no more than the wall time of the steps."""
    s = make_scheduler(
        tiny_model_dir, device="cpu", dtype="float32", disable_overlap_schedule=not overlap
    )
    assert s.enable_overlap == overlap
    for i in range(3):
        submit(s, f"r{i}", list(range(10 + i, 30)), {"max_new_tokens": 12, "temperature": 0})
    t0 = time.perf_counter()
    run_until_idle(s, {})
    wall = time.perf_counter() - t0
    info = s.internal_state()
    secs = {k: info[f"host_s_{k}"] for k in HOST_PHASES}
    assert all(secs[k] > 0 for k in ("plan", "build", "launch", "commit", "flush"))
    assert (secs["resolve"] > 0) == overlap
    assert secs["recv"] == 0.0  # submitted directly, not through the socket loop
    assert sum(secs.values()) <= wall
    # the prefill step's part of each phase: positive (one prefill step ran), and less than
    # the phase (decode steps ran too)
    for k in EXTEND_PHASES:
        assert 0 < info[f"host_s_{k}_extend"] < secs[k], k


def test_scheduler_counts_prefill_steps(tiny_model_dir) -> None:
    """prefill_steps / prefill_reqs / prefill_tokens: three requests waiting together take one
    prefill step; one arriving later takes its own; the tokens are the prompts' (no cache hit:
    the prompts share no prefix)."""
    s = make_scheduler(tiny_model_dir, device="cpu", dtype="float32")
    prompts = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(4)]
    for i in range(3):
        submit(s, f"r{i}", prompts[i], {"max_new_tokens": 4, "temperature": 0})
    run_until_idle(s, {})
    submit(s, "r3", prompts[3], {"max_new_tokens": 4, "temperature": 0})
    run_until_idle(s, {})
    info = s.internal_state()
    assert (info["prefill_steps"], info["prefill_reqs"]) == (2, 4)
    assert info["prefill_tokens"] == sum(len(p) for p in prompts) - info_cached(info)


def info_cached(info: dict) -> int:
    """Prompt tokens served from the prefix cache (not computed by a prefill)."""
    return round(info["cache_hit_rate"] * info["prompt_tokens"])


def test_scheduler_counts_its_forwards_by_kind_and_path(tiny_model_dir) -> None:
    """ForwardCounters through a real CPU scheduler (no CUDA graphs: every forward eager):
    the prefill steps and their computed tokens are the scheduler's own counts, every other
    forward is a decode step of one token per running request, and each path's host time is
    positive exactly when it ran."""
    s = make_scheduler(tiny_model_dir, device="cpu", dtype="float32")
    prompts = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]
    for i, p in enumerate(prompts):
        submit(s, f"r{i}", p, {"max_new_tokens": 5 + i, "temperature": 0, "ignore_eos": True})
    run_until_idle(s, {})
    info = s.internal_state()
    prefills, steps = info["prefill_steps"], info["forward_steps"]
    assert info["runner_prefill_eager_steps"] == prefills
    assert info["runner_prefill_eager_tokens"] == info["prefill_tokens"]
    assert info["runner_decode_eager_steps"] == steps - prefills
    # 5 + 6 + 7 output tokens, the first of each from the prefill: 4 + 5 + 6 decode tokens
    assert info["runner_decode_eager_tokens"] == 15
    assert info["runner_prefill_graph_steps"] == info["runner_decode_graph_steps"] == 0
    assert info["runner_prefill_graph_s"] == info["runner_decode_graph_s"] == 0.0
    assert info["runner_prefill_eager_s"] > 0 and info["runner_decode_eager_s"] > 0


def test_overlap_client_splits_its_launches(tiny_model_dir) -> None:
    """TpModelWorkerClient.launch_info through a real CPU scheduler with overlap: every part is
    positive, the prefill steps' share of each is smaller (the worker's positive: a prefill
    step has no future id to resolve or write, so those shares are only the checks' time),
    and the worker's launch holds the runner's forwards (which run inside it)."""
    s = make_scheduler(
        tiny_model_dir, device="cpu", dtype="float32", disable_overlap_schedule=False
    )
    for i in range(2):
        submit(s, f"r{i}", list(range(10 + i, 30)), {"max_new_tokens": 6, "temperature": 0})
    run_until_idle(s, {})
    info = s.internal_state()
    for part in ("future_ids", "worker", "future_write"):
        assert 0 <= info[f"launch_s_{part}_extend"] < info[f"launch_s_{part}"], part
    assert info["launch_s_worker_extend"] > 0
    runner = sum(
        info[f"runner_{k}_{p}_s"] for k in ("prefill", "decode") for p in ("graph", "eager")
    )
    assert 0 < runner <= info["launch_s_worker"] <= info["host_s_launch"]
    plain = make_scheduler(tiny_model_dir, device="cpu", dtype="float32")
    assert not any(k.startswith("launch_s_") for k in plain.internal_state())  # no client
