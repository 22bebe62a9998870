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

Of plan, build, launch and commit, the part spent on prefill (extend) steps is also kept
(``host_s_<phase>_extend``, included in ``host_s_<phase>``): on the H200 at c = 16 a
speculative server whose steps never drafted spent ~210 us more per step than a plain one
(twenty-sixth session, launch +119, plan +54, commit +27), while in-process decode steps of
the two cost the same (probe_host_waits.py at bs 16), which points at the prefill steps
(~1 in 40 there) or at the server around them; the split tells which.
"""

from __future__ import annotations

import time

HOST_PHASES = ("recv", "plan", "build", "launch", "resolve", "commit", "flush")
EXTEND_PHASES = ("plan", "build", "launch", "commit")  # also kept for prefill steps alone


Mark = tuple[float, float]  # (time.perf_counter(), nested seconds so far) at a phase start


class HostPhases:
    """Cumulative seconds per phase (HOST_PHASES), each counted once. Usage: ``t =
    phases.mark()`` at a phase's start, then ``t = phases.add("plan", t)`` at its end (which
    returns the next phase's start, so consecutive phases chain). A phase that runs inside
    another one (the commit and flush of a drain, inside `plan`) ends with ``add_nested``: its
    time then leaves the enclosing phase's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(HOST_PHASES, 0.0)
        self.extend_seconds: dict[str, float] = dict.fromkeys(EXTEND_PHASES, 0.0)
        self._nested = 0.0  # seconds added by add_nested so far

    def mark(self) -> Mark:
        return time.perf_counter(), self._nested

    def add(self, phase: str, start: Mark, extend: bool = False) -> Mark:
        """Add the time since `start` to `phase` (and, with extend, to its prefill part), less
        what nested phases took meanwhile; returns a mark for the next phase. Raises KeyError
        for a phase not in HOST_PHASES (with extend: not in EXTEND_PHASES)."""
        now = time.perf_counter()
        t0, nested0 = start
        dt = (now - t0) - (self._nested - nested0)
        self.seconds[phase] += dt
        if extend:
            self.extend_seconds[phase] += dt
        return now, self._nested

    def add_nested(self, phase: str, start: Mark, extend: bool = False) -> Mark:
        """add() for a phase that may run inside another: its time is also taken out of the
        enclosing phase when that one is added."""
        now = time.perf_counter()
        t0, nested0 = start
        dt = (now - t0) - (self._nested - nested0)
        self.seconds[phase] += dt
        if extend:
            self.extend_seconds[phase] += dt
        self._nested += dt
        return now, self._nested

    def info(self) -> dict[str, float]:
        """Server-info keys: ``host_s_<phase>`` and ``host_s_<phase>_extend`` (seconds since
        start, float)."""
        out = {f"host_s_{k}": v for k, v in self.seconds.items()}
        out.update({f"host_s_{k}_extend": v for k, v in self.extend_seconds.items()})
        return out
