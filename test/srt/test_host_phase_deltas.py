"""benchmark/host_phase_deltas.py: per-point prefill / decode split of the host phases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from host_phase_deltas import excess_over, main, point_deltas  # noqa: E402


def _point(config, instance, rnd, c, steps, prefills, reqs, launch_s, launch_ext_s):
    return {
        "config": config,
        "instance": instance,
        "round": rnd,
        "concurrency": c,
        "output_throughput": 100.0,
        "server_state": {
            "forward_steps": steps,
            "prefill_steps": prefills,
            "prefill_reqs": reqs,
            "host_s_launch": launch_s,
            "host_s_launch_extend": launch_ext_s,
        },
    }


def test_each_point_is_split_against_the_previous_point_of_its_instance():
    points = [
        _point("a", 0, 0, 2, 1000, 10, 12, 1.0, 0.02),  # from the server's start
        _point("b", 0, 0, 2, 500, 5, 5, 0.3, 0.01),
        _point("a", 0, 0, 8, 1600, 30, 40, 1.6, 0.08),  # + 600 steps, 20 prefills
        _point("a", 1, 1, 2, 200, 4, 4, 0.1, 0.004),  # a fresh instance starts over
    ]
    rows = point_deltas(points, ("launch",))
    a8 = next(r for r in rows if r["config"] == "a" and r["concurrency"] == 8)
    assert (a8["forward_steps"], a8["prefill_steps"], a8["prefill_reqs"]) == (600, 20, 28)
    assert a8["launch_ms_per_prefill"] == pytest.approx(1e3 * 0.06 / 20)  # 3.0 ms
    assert a8["launch_us_per_decode"] == pytest.approx(1e6 * (0.6 - 0.06) / 580, abs=0.05)
    a1 = next(r for r in rows if r["config"] == "a" and r["instance"] == 1)
    assert a1["forward_steps"] == 200 and a1["launch_ms_per_prefill"] == pytest.approx(1.0)
    b = next(r for r in rows if r["config"] == "b")
    assert b["launch_us_per_decode"] == pytest.approx(1e6 * 0.29 / 495, abs=0.05)


def test_a_point_without_prefills_has_no_prefill_figure(tmp_path):
    points = [
        _point("a", 0, 0, 2, 100, 2, 2, 0.1, 0.002),
        _point("a", 0, 1, 2, 150, 2, 2, 0.15, 0.002),
    ]
    rows = point_deltas(points, ("launch",))
    assert rows[1]["prefill_steps"] == 0 and rows[1]["launch_ms_per_prefill"] is None
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"points": points}))
    assert len(main([str(path), "--phases", "launch"])) == 2


@pytest.mark.parametrize("argv", [["--phases", "flush"], []])
def test_bad_input_is_a_usage_error(tmp_path, argv):
    path = tmp_path / "r.json"
    path.write_text("{}")  # no points: not a paired result
    with pytest.raises(SystemExit) as e:
        main([str(path), *argv])
    assert e.value.code == 2


def test_excess_over_pairs_points_by_round_and_concurrency(tmp_path):
    points = [
        _point("base", 0, 0, 2, 1000, 10, 10, 1.0, 0.01),  # 1 ms per prefill, 1000 us/decode
        _point("x", 0, 0, 2, 1000, 10, 10, 1.2, 0.03),  # 3 ms per prefill
        _point("x", 0, 0, 8, 1500, 10, 10, 1.5, 0.03),  # no base point at c = 8: left out
    ]
    rows = excess_over(point_deltas(points, ("launch",)), "base", ("launch",))
    assert len(rows) == 1 and rows[0]["config"] == "x"
    assert rows[0]["launch_ms_per_prefill"] == pytest.approx(2.0)
    assert rows[0]["launch_us_per_decode"] == pytest.approx(1e6 * 0.18 / 990, abs=0.11)
    with pytest.raises(ValueError, match="nope"):
        excess_over(rows, "nope", ("launch",))
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"points": points}))
    with pytest.raises(SystemExit) as e:
        main([str(path), "--excess-over", "nope"])
    assert e.value.code == 2


def test_runner_counters_split_prefills_by_path():
    """Servers that report ForwardCounters: graph and eager prefill steps per point and ms of
    host time per prefill step of each path; older results have no such columns."""
    states = [{}, {}]
    for st, (g, gs, e, es) in zip(
        states, [(10, 0.004, 2, 0.006), (30, 0.012, 2, 0.006)], strict=True
    ):
        for kind in ("prefill", "decode"):
            for path, n, sec in (("graph", g, gs), ("eager", e, es)):
                st[f"runner_{kind}_{path}_steps"] = n
                st[f"runner_{kind}_{path}_tokens"] = 50 * n
                st[f"runner_{kind}_{path}_s"] = sec
    points = [
        _point("a", 0, 0, 2, 100, 12, 12, 0.1, 0.01),
        _point("a", 0, 1, 2, 300, 32, 32, 0.3, 0.03),
    ]
    for p, st in zip(points, states, strict=True):
        p["server_state"].update(st)
    rows = point_deltas(points, ("launch",))
    assert (rows[0]["prefill_graph"], rows[0]["prefill_eager"]) == (10, 2)
    assert rows[0]["fwd_ms_prefill_graph"] == pytest.approx(0.4)
    assert rows[0]["fwd_ms_prefill_eager"] == pytest.approx(3.0)
    assert (rows[1]["prefill_graph"], rows[1]["prefill_eager"]) == (20, 0)
    assert rows[1]["fwd_ms_prefill_graph"] == pytest.approx(0.4)
    assert rows[1]["fwd_ms_prefill_eager"] is None
    old = point_deltas([_point("a", 0, 0, 2, 100, 2, 2, 0.1, 0.002)], ("launch",))
    assert "prefill_graph" not in old[0]


def test_launch_parts_per_decode_step():
    """launch_deltas: us per decode step of the worker's launch and the future ids, the prefill
    steps' shares taken out, {} for servers without them; runner_deltas: of the runner's
    decode forwards."""
    from host_phase_deltas import launch_deltas, runner_deltas

    before = {
        "launch_s_worker": 1.0, "launch_s_worker_extend": 0.2,
        "launch_s_future_ids": 0.1, "launch_s_future_ids_extend": 0.01,
        "launch_s_future_write": 0.1, "launch_s_future_write_extend": 0.01,
        "runner_decode_graph_s": 0.5, "runner_decode_eager_s": 0.0,
    }  # fmt: skip
    after = {
        "launch_s_worker": 1.5, "launch_s_worker_extend": 0.3,  # 0.4 s on decode steps
        "launch_s_future_ids": 0.15, "launch_s_future_ids_extend": 0.02,  # 0.04
        "launch_s_future_write": 0.13, "launch_s_future_write_extend": 0.01,  # 0.03
        "runner_decode_graph_s": 0.6, "runner_decode_eager_s": 0.05,  # 0.15
    }  # fmt: skip
    got = launch_deltas(before, after, 1000)
    assert got == pytest.approx({"worker_us_per_decode": 400.0, "future_us_per_decode": 70.0})
    before |= {"runner_prefill_graph_steps": 0, "runner_prefill_eager_steps": 0}
    after |= {"runner_prefill_graph_steps": 0, "runner_prefill_eager_steps": 0}
    assert runner_deltas(before, after, 1000)["runner_us_per_decode"] == pytest.approx(150.0)
    assert runner_deltas(before, after, 0)["runner_us_per_decode"] is None
    assert launch_deltas({}, {"forward_steps": 3}, 1000) == {}
    assert launch_deltas(before, after, 0) == {}
