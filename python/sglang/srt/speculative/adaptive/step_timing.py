"""StepTiming: what a committed decode step cost the server, for the adaptive controller.

With `count_overhead` (the default) a step's cost is the wall time between its commit and the
previous decode step's commit, when the two steps are consecutive by launch index; otherwise
its forward time plus an EMA of the scheduler overhead (wall interval minus forward time of
consecutive steps). Without it, the forward time alone. Under overlap scheduling a plain
step's host work hides behind the previous step while a drafting step's does not (it drains
the pipeline), so forward times alone favour drafting.

Which steps are timed on the device (wants_forward_time, the scheduler's SpecPlan.time_forward)
is decided here too: a plain step that follows a plain one is measured by its wall interval,
so its forward time only feeds the overhead EMA, and it is timed once in
OVERHEAD_SAMPLE_EVERY.
"""

from __future__ import annotations

OVERHEAD_EMA = 0.1  # weight of a new scheduler-overhead sample
# A plain step that follows a plain one is timed on the device once in this many
# (wants_forward_time): its forward time only feeds the overhead EMA (its measured time is
# the wall interval between commits), and the timing costs ~10 us of host work per step
# (two CUDA events and their elapsed time: H200, SmolLM2, batch 1, cProfile of the
# scheduler thread, twenty-ninth session), 1% of a host-bound step.
OVERHEAD_SAMPLE_EVERY = 8


class StepTiming:
    """Wall intervals between decode commits, the overhead EMA, and which steps to time.

    Args:
        count_overhead: measure a step by the wall interval between commits (else by its
            forward time; every step is then timed).
    """

    def __init__(self, count_overhead: bool) -> None:
        self.count_overhead = count_overhead
        self.overhead_s = 0.0  # EMA of step wall time minus forward time (seconds)
        self._untimed_left = 0  # plain steps after a plain one still to run untimed
        self._last_commit: tuple[int, float] | None = None  # (step index, perf_counter)

    def wants_forward_time(self, plain: bool, follows_plain: bool) -> bool:
        """Whether the worker should time the step about to launch on the device (SpecPlan.
        time_forward). plain: every d_i = 0; follows_plain: the step launched before it was a
        plain decode step too, so its commit will directly follow that one's (measure then
        takes the wall interval between the two). Such steps are timed once in
        OVERHEAD_SAMPLE_EVERY, which is enough for the overhead EMA; every other step is
        timed (a drafting step, the first plain step after a drafting step or a prefill, and
        every step without count_overhead, whose measured time is the forward time)."""
        if not (plain and follows_plain and self.count_overhead):
            return True
        if self._untimed_left > 0:
            self._untimed_left -= 1
            return False
        self._untimed_left = OVERHEAD_SAMPLE_EVERY - 1
        return True

    def measure(
        self,
        step_index: int,
        now: float,
        forward_time_s: float | None,
        plain_after_plain: bool,
    ) -> tuple[float | None, float | None]:
        """Record the commit of decode step `step_index` at perf_counter `now`. Returns
        (interval: wall seconds since the previous decode commit when that step was launched
        right before this one, else None; measured: the step's cost in seconds, see the module
        docstring, or None for an untimed step without an interval: no sample).

        forward_time_s: the step's forward time, or None when it was not timed; it feeds the
        overhead EMA when the step is consecutive. plain_after_plain: the step and the
        previous one drafted nothing; with count_overhead it was timed once in
        OVERHEAD_SAMPLE_EVERY, so its sample stands for that many steps in the EMA, which
        would otherwise lean towards the always-timed drafting steps' overhead."""
        last = self._last_commit
        interval = None
        if last is not None and last[0] == step_index - 1:
            interval = now - last[1]
            if forward_time_s is not None:
                sample = max(0.0, interval - forward_time_s)
                weight = OVERHEAD_EMA
                if plain_after_plain and self.count_overhead:
                    weight = 1.0 - (1.0 - OVERHEAD_EMA) ** OVERHEAD_SAMPLE_EVERY
                self.overhead_s += weight * (sample - self.overhead_s)
        self._last_commit = (step_index, now)
        measured = forward_time_s
        if self.count_overhead:
            if interval is not None:
                measured = interval
            elif forward_time_s is not None:
                measured = forward_time_s + self.overhead_s
        return interval, measured
