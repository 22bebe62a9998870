"""HostProbe: how fast the machine's CPUs run Python at each moment of a benchmark run.

Why: on the H200 machine the host's speed drifts by up to 2x within seconds. In the
twenty-ninth session's A/A run at c = 1 (SmolLM2, host-bound: the scheduler thread busy
throughout), identical no_spec servers ranged 715-1312 output tok/s between points, and each
point's tok/s times its scheduler's launch-phase microseconds per step stayed within 514-548k
(the point's host speed explained nearly all of it). A paired ratio of two configurations then
measures when each point ran more than what the configurations cost. The probe measures the
host's speed independently of any server, so that a host-bound point's throughput can be read
per unit of host speed (paired_serving.py --host-probe-cpu, ratio_verdict.py's host-adjusted
table).

A worker process pinned to one CPU (`--host-probe-cpu`, not one of the servers' or the
client's) runs a fixed pure-Python work unit (attribute access, list and dict operations, as
a scheduler step does; about 1 ms) every `period_s`, 10% of its CPU, and appends
"<unix time at the unit's end> <unit microseconds>" to a file. `window(t0, t1)` gives the median
unit time of the units that ended in a point's wall-clock window.

Whether the probe's CPU drifts with the servers' CPUs (a machine-wide effect: CPU steal,
frequency, a neighbour on the host) rather than on its own is an empirical question that each
run answers: paired_serving.py reports, per configuration, the correlation of its points'
log throughput with their log probe time (strongly negative: the probe explains the drift).
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

UNIT_ITEMS = 2000  # objects per work unit (about 1 ms of Python on the H200 host)


class _Item:
    __slots__ = ("a", "b")

    def __init__(self, a: int) -> None:
        self.a, self.b = a, a + 1


def work_unit(n: int = UNIT_ITEMS) -> int:
    """A fixed amount of pure-Python work (object creation, attribute reads, list and dict
    operations); returns a checksum so that nothing is optimised away."""
    items = [_Item(i) for i in range(n)]
    index = {it.a: it for it in items}
    total = 0
    for it in items:
        total += index[it.a].b - it.a
    return total + len(sorted(index, reverse=True))


def _worker(path: str, period_s: float, cpu: int | None, parent: int) -> None:
    """Pin to `cpu` (None: leave the affinity), then run work units every period_s, appending
    '<end unix time> <us>' lines, until the parent process `parent` is gone (a parent killed
    by SIGKILL cannot stop it, and an orphan would keep loading its core)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with open(path, "a", buffering=1) as f:
        while os.getppid() == parent:
            t = time.perf_counter()
            work_unit()
            d = time.perf_counter() - t
            f.write(f"{time.time():.6f} {1e6 * d:.1f}\n")
            time.sleep(max(0.0, period_s - d))


class HostProbe:
    """The probe's worker process on CPU `cpu` (None: unpinned), sampling every period_s.

    start() launches it; window(t0, t1) reads the units that ended in [t0, t1] (unix time);
    stop() ends it. Raises ValueError for period_s <= 0."""

    def __init__(self, cpu: int | None, period_s: float = 0.01) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.cpu, self.period_s = cpu, period_s
        fd, self.path = tempfile.mkstemp(prefix="host_probe_", suffix=".txt")
        os.close(fd)
        self.proc: subprocess.Popen | None = None

    def start(self) -> HostProbe:
        """Launch the worker; on failure the sample file is removed and the error raised."""
        code = (
            f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import host_probe; host_probe._worker({self.path!r}, {self.period_s!r}, "
            f"{self.cpu!r}, {os.getpid()})"
        )
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code])
        except BaseException:
            self.stop()
            raise
        return self

    def exit_code(self) -> int | None:
        """The worker's exit code once it has died (it never exits on its own), else None."""
        return None if self.proc is None else self.proc.poll()

    def samples(self) -> list[tuple[float, float]]:
        """[(end unix time, unit us)] so far (a line being written is skipped)."""
        out = []
        with open(self.path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and line.endswith("\n"):
                    out.append((float(parts[0]), float(parts[1])))
        return out

    def window(self, t0: float, t1: float) -> dict | None:
        """{"median_us", "units"} of the units that ended in [t0, t1] (unix time), or None
        when none did."""
        us = [d for t, d in self.samples() if t0 <= t <= t1]
        if not us:
            return None
        return {"median_us": statistics.median(us), "units": len(us)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> HostProbe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# A point is host-bound when its scheduler process kept at least this many cores busy
# (cpu_util["scheduler"], sweep_serving._cpu_util): its throughput then scales with the host's
# speed. Elsewhere (a GPU-bound point) an adjustment would only add the probe's noise.
HOST_BOUND_UTIL = 0.9


def host_bound(point: dict) -> bool:
    """Whether a paired_serving point's scheduler kept a core busy (HOST_BOUND_UTIL)."""
    return (point.get("cpu_util") or {}).get("scheduler", 0.0) >= HOST_BOUND_UTIL


def host_adjusted_ratio(point: dict, base: dict) -> float | None:
    """point's output tok/s over base's (same round), each per unit of host speed: tok/s times
    the point's median probe time (a point that ran while the host was slow is credited for
    it). Only for host-bound points (host_bound: the scheduler's core busy throughout), where
    throughput scales with the host's speed; None when either point is not host-bound or
    lacks a probe time or a throughput."""
    if not (host_bound(point) and host_bound(base)):
        return None
    pu, bu = point.get("host_probe_us"), base.get("host_probe_us")
    pt, bt = point.get("output_throughput"), base.get("output_throughput")
    if not (pu and bu and pt and bt):
        return None
    return (pt * pu) / (bt * bu)


def log_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of log xs and log ys (positive values, same length); None for fewer
    than 3 pairs or a constant side."""
    if len(xs) != len(ys) or len(xs) < 3 or min(xs) <= 0 or min(ys) <= 0:
        return None
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxy = sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True))
    sxx = sum((a - mx) ** 2 for a in lx)
    syy = sum((b - my) ** 2 for b in ly)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)
