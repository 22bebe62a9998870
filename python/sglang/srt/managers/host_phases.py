"""Wall time the scheduler thread spends in each phase of its loop, summed since start.

Phases (Scheduler.event_loop_overlap / step_overlap, and the same names without overlap):

- ``recv``: polling the tokenizer socket and handling what arrived;
- ``plan``: BatchBuilder.get_next_batch_to_run (the batch; draft lengths on a speculative
  server; a drain of the in-flight step when the next one cannot pipeline is counted here too);
- ``build``: build_model_worker_batch and the output processor's launch bookkeeping;
- ``launch``: the worker's forward launch (with overlap: queueing the step; without: the whole
  forward, device wait included);
- ``resolve``: waiting for the in-flight step's results (overlap only; mostly device time);
- ``commit``: OutputProcessor.process_batch_result (tokens, KV lengths, speculative counters);
- ``flush``: OutputProcessor.flush (detokenization and the message to the tokenizer manager).

Why: py-spy of two servers at c = 1 on the H200 (benchmark/README.md, fourteenth session) put
the adaptive server's scheduler thread 14% busier per request than a plain one's, spread over
several phases; sampling cannot give microseconds per step per phase. These sums can: the
serving benchmarks read them from /get_server_info before and after a point (keys
``host_s_<phase>``, seconds) and divide by the forward steps in between. Cost: one
time.perf_counter() per phase boundary, about 7 per step.
"""

from __future__ import annotations

import time

HOST_PHASES = ("recv", "plan", "build", "launch", "resolve", "commit", "flush")


Mark = tuple[float, float]  # (time.perf_counter(), nested seconds so far) at a phase start


class HostPhases:
    """Cumulative seconds per phase (HOST_PHASES), each counted once. Usage: ``t =
    phases.mark()`` at a phase's start, then ``t = phases.add("plan", t)`` at its end (which
    returns the next phase's start, so consecutive phases chain). A phase that runs inside
    another one (the commit and flush of a drain, inside `plan`) ends with ``add_nested``: its
    time then leaves the enclosing phase's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(HOST_PHASES, 0.0)
        self._nested = 0.0  # seconds added by add_nested so far

    def mark(self) -> Mark:
        return time.perf_counter(), self._nested

    def add(self, phase: str, start: Mark) -> Mark:
        """Add the time since `start` to `phase`, less what nested phases took meanwhile;
        returns a mark for the next phase. Raises KeyError for a phase not in HOST_PHASES."""
        now = time.perf_counter()
        t0, nested0 = start
        self.seconds[phase] += (now - t0) - (self._nested - nested0)
        return now, self._nested

    def add_nested(self, phase: str, start: Mark) -> Mark:
        """add() for a phase that may run inside another: its time is also taken out of the
        enclosing phase when that one is added."""
        now = time.perf_counter()
        t0, nested0 = start
        dt = (now - t0) - (self._nested - nested0)
        self.seconds[phase] += dt
        self._nested += dt
        return now, self._nested

    def info(self) -> dict[str, float]:
        """Server-info keys: ``host_s_<phase>`` (seconds since start, float)."""
        return {f"host_s_{k}": v for k, v in self.seconds.items()}
