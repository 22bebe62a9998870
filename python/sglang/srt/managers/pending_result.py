"""PendingResult: a step whose kernels are queued on the device but whose tokens have not been
read back to the host yet.

Why: a worker that returns host lists must wait for the GPU at the end of every step, so the
next step's kernels are queued only after that wait and the GPU idles while the host prepares
them (per step: input packing, attention planning, graph launch, sampling launch). With a
PendingResult the worker queues step N, starts an asynchronous copy of its sampled ids into
pinned host memory, records an event and returns at once; it can queue step N + 1 (whose input
ids refer to step N's tokens on the device, see tp_worker_overlap_thread.py) while step N runs.
The scheduler thread calls finish(), which waits for the event (releasing the GIL) and builds
the GenerationBatchResult. Upstream SGLang's overlap scheduler reads results back the same way
(a copy-done event per batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.managers.schedule_batch import GenerationBatchResult

StepStart = tuple[float, "torch.cuda.Event | None", bool]


def begin_step(device: torch.device, timed: bool = True) -> StepStart:
    """Mark the start of a launched step: (perf_counter, timing event recorded on the current
    stream on CUDA when `timed`, else None; `timed`). Pass it to PendingResult.from_device_ids.
    Only the adaptive speculation policy reads a step's device time (forward_time_s), and only
    on the steps it asks for (SpecPlan.time_forward); a step nobody times passes timed=False
    and saves two CUDA calls and a read of the elapsed time (its forward_time_s is then the
    wall time from launch to finish, and its result's forward_timed is False)."""
    start = None
    if timed and device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    return time.perf_counter(), start, timed


def copy_to_host_async(
    t: torch.Tensor, timed: bool = True
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying t (any device) to pinned host memory. Returns (host tensor, event recorded
    after the copy on the current stream, a timing event when `timed`); read the host tensor
    only after event.synchronize(). On the CPU: (t, None)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event(enable_timing=timed)
    event.record()
    return host, event


class PendingResult:
    """One launched step.

    Attributes:
        sampled_rows: [n] request indices (into the ModelWorkerBatch) that sampled a token.
        next_ids_device: [n] int64 on the worker's device, the sampled token of each row in
            sampled_rows, valid on the worker's stream after the step's kernels; None when the
            result was computed synchronously (then finish() returns it at once).
    """

    def __init__(
        self,
        finish_fn: Callable[[], GenerationBatchResult],
        sampled_rows: list[int],
        next_ids_device: torch.Tensor | None,
        start_event: Any = None,  # torch.cuda.Event(enable_timing=True) before the step
        end_event: Any = None,  # torch.cuda.Event(enable_timing=True) after its host copy
        launched_at: float | None = None,  # perf_counter when the worker began the step
        timed: bool = True,  # False: nobody asked for the step's time (forward_timed)
    ) -> None:
        self._finish_fn = finish_fn
        self._result: GenerationBatchResult | None = None
        self.sampled_rows = sampled_rows
        self.next_ids_device = next_ids_device
        self.start_event = start_event
        self.end_event = end_event
        self.launched_at = time.perf_counter() if launched_at is None else launched_at
        self.timed = timed
        # Inputs of the step (the ModelWorkerBatch): their device tensors were allocated on the
        # scheduler's stream and are read by the worker's; held until the step finished.
        self.keep_alive: Any = None

    @classmethod
    def from_device_ids(
        cls,
        rows: list[int],
        ids: torch.Tensor,
        to_result: Callable[[list[int]], GenerationBatchResult],
        began: StepStart,
    ) -> PendingResult:
        """A step whose sampled ids ([len(rows)] int64, device) are queued: start their copy
        to the host; finish() calls to_result(ids as a host list). began: begin_step()'s
        value, taken before the step's kernels were queued."""
        launched_at, start, timed = began
        host, end = copy_to_host_async(ids, timed=start is not None)
        return cls(lambda: to_result(host.tolist()), rows, ids, start, end, launched_at, timed)

    @classmethod
    def done(cls, result: GenerationBatchResult) -> PendingResult:
        """A result computed synchronously (host lists already there)."""
        rows = [i for i, t in enumerate(result.next_token_ids) if t is not None]
        p = cls(lambda: result, rows, None)
        p._result = result
        return p

    def finish(self) -> GenerationBatchResult:
        """Wait for the step (the GIL is released while waiting) and return its result; the
        same object on every call. forward_time_s is the device time between the step's two
        events (the step's own execution, not the queueing before it) when it has events;
        forward_timed says whether the step was timed at all (begin_step)."""
        if self._result is None:
            if self.end_event is not None:
                self.end_event.synchronize()
            result = self._finish_fn()
            self.keep_alive = None
            if self.start_event is not None:
                result.forward_time_s = self.start_event.elapsed_time(self.end_event) / 1e3
            else:
                result.forward_time_s = time.perf_counter() - self.launched_at
            result.forward_timed = self.timed
            self._result = result
        return self._result
