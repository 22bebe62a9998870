"""benchmark/host_probe.py: the host-speed probe of paired runs, and the ratios per unit of
host speed that paired_serving.py and ratio_verdict.py derive from it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))

from host_probe import (  # noqa: E402
    HOST_BOUND_UTIL,
    HostProbe,
    host_adjusted_ratio,
    log_correlation,
    work_unit,
)
from paired_report import markdown, summarize  # noqa: E402
from ratio_verdict import verdicts  # noqa: E402


def test_work_unit_is_a_fixed_amount_of_work():
    assert work_unit(100) == work_unit(100) == 100 + 100  # 100 items, b - a == 1 each
    assert work_unit(10) == 20


def test_probe_samples_while_running_and_cleans_up():
    cpu = min(os.sched_getaffinity(0))
    probe = HostProbe(cpu, period_s=0.005)
    with probe:
        t0 = time.time()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(probe.samples()) < 10:
            time.sleep(0.05)
        w = probe.window(t0 - 60, time.time())
        assert w is not None and w["units"] >= 10
        assert w["median_us"] > 0
        assert probe.window(t0 - 3600, t0 - 1800) is None  # nothing ended back then
        pid = probe.proc.pid
    assert probe.proc.poll() is not None  # the worker was stopped
    assert not os.path.exists(probe.path)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ValueError, match="period_s"):
        HostProbe(None, period_s=0)


BUSY = {"cpu_util": {"client": 0.1, "http": 0.2, "scheduler": 1.0}}  # host-bound


def test_probe_worker_exits_when_its_parent_is_killed(tmp_path):
    """A parent killed by SIGKILL cannot stop the worker; it notices and exits by itself."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark")
    pid_file = tmp_path / "worker.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys, time; sys.path.insert(0, {bench!r}); import host_probe; "
            "p = host_probe.HostProbe(None, period_s=0.005).start(); "
            f"open({str(pid_file)!r}, 'w').write(str(p.proc.pid)); time.sleep(60)",
        ]
    )
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    os.kill(worker, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{worker}/stat") as f:  # exited but not yet reaped by init
            if f.read().split(") ")[1].startswith("Z"):
                break
        time.sleep(0.05)
    else:
        os.kill(worker, 9)
        pytest.fail("the probe's worker outlived its parent")


def test_host_adjusted_ratio_credits_a_point_that_ran_on_a_slow_host():
    base = {"output_throughput": 1000.0, "host_probe_us": 1000.0, **BUSY}
    slow = {"output_throughput": 600.0, "host_probe_us": 1600.0, **BUSY}  # host at 1/1.6 speed
    assert host_adjusted_ratio(slow, base) == pytest.approx(0.96)
    assert host_adjusted_ratio({"output_throughput": 600.0, **BUSY}, base) is None
    zero = {"output_throughput": 0.0, "host_probe_us": 1.0, **BUSY}
    assert host_adjusted_ratio(slow, zero) is None
    # a point whose scheduler was not busy throughout (GPU-bound) is not adjusted
    gpu_bound = {**slow, "cpu_util": {"scheduler": HOST_BOUND_UTIL - 0.2}}
    assert host_adjusted_ratio(gpu_bound, base) is None
    assert host_adjusted_ratio(slow, {**base, "cpu_util": {}}) is None


def test_log_correlation():
    xs = [1.0, 2.0, 4.0, 8.0]
    assert log_correlation(xs, [1 / x for x in xs]) == pytest.approx(-1.0)
    assert log_correlation(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert log_correlation(xs[:2], xs[:2]) is None  # fewer than 3 pairs
    assert log_correlation(xs, [5.0] * 4) is None  # a constant side


def _pt(r: int, name: str, tput: float, probe_us: float) -> dict:
    return {
        "concurrency": 1,
        "round": r,
        "config": name,
        "status": "ok",
        "output_throughput": tput,
        "median_ttft_ms": 5.0,
        "median_itl_ms": 1.0,
        "host_probe_us": probe_us,
        **BUSY,
    }


def test_a_drifting_host_hides_a_ratio_that_the_probe_recovers():
    """Host-bound points whose throughput follows the host's speed (drifting 2x between
    points): the raw ratios scatter (verdict open), while per unit of host speed every round
    gives the true 0.99 (verdict meets), and the probe's correlation with throughput is -1."""
    speeds = [1.0, 0.6, 1.3, 0.8, 1.1, 0.7, 1.2, 0.9, 0.75, 1.25, 0.95, 0.65]
    true = {"no_spec": 1.0, "adaptive": 0.99, "no_spec_b": 1.0}
    pts, k = [], 0
    for r in range(4):
        for name in ("no_spec", "adaptive", "no_spec_b"):
            s = speeds[k]
            k += 1
            pts.append(_pt(r, name, 1000 * true[name] * s, 1000 / s))
    cfgs = ["no_spec", "adaptive", "no_spec_b"]
    summary = {r["config"]: r for r in summarize(pts, cfgs)}
    a = summary["adaptive"]
    assert a["ratio_host_adjusted_median"] == pytest.approx(0.99)
    assert a["ratio_host_adjusted_min"] == pytest.approx(0.99)
    assert a["host_probe_log_corr"] == pytest.approx(-1.0)
    assert a["ratio_to_base_max"] / a["ratio_to_base_min"] > 1.5  # the raw ratios scatter
    result = {"settings": {"configs": cfgs}, "points": pts}
    (raw,) = verdicts(result, 0.97)
    (adjusted,) = verdicts(result, 0.97, host_adjusted=True)
    assert raw["verdict"] == "open"
    assert adjusted["verdict"] == "meets" and adjusted["geomean"] == pytest.approx(0.99)
    md = markdown(
        {
            "meta": {"command": "python benchmark/paired_serving.py --host-probe-cpu 15"},
            "settings": {"preset": "smollm2", "configs": cfgs, "rounds": 4},
            "summary": summarize(pts, cfgs),
            "points": pts,
        }
    )
    assert "ratio per unit of host speed (median, min-max) |" in md
    assert "| -1.00 | 0.990 (0.990-0.990) |" in md
    assert "per unit of host speed (host_probe.py" in md  # the second verdict table
    assert math.isclose(adjusted["lower"], 0.99, rel_tol=1e-6)  # no spread at all
