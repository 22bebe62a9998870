"""TpModelWorkerClient: runs the model worker on its own thread so that the scheduler can build
step N+1 on the CPU while step N runs (overlap scheduling, `--disable-overlap-schedule` off).

The client wraps a TpModelWorker or an EAGLEWorkerV2 and owns no request state: it executes
ModelWorkerBatches in the order they were launched and hands back their GenerationBatchResults
in the same order. Its only state is the future-token buffer:

- When the scheduler builds step N+1 before step N's sampled tokens are known, the input id of
  a request's last (not yet known) token is the placeholder -(future_index + 1), where
  future_index is the request's slot in the ReqToTokenPool (`future_placeholder`).
- The worker queues step N's kernels and returns a PendingResult at once
  (`forward_batch_generation_launch`, pending_result.py); the worker thread then writes each
  sampled request's token into future_ids[req_pool_index] with a device-side scatter, queued
  on the same stream after step N's sampling.
- Before step N+1 runs, the worker thread replaces placeholders in its input ids
  (`resolve_future_ids`, a torch.where on the device), again queued after step N: nothing on
  the worker thread waits for the GPU, so step N+1's kernels are queued while step N runs and
  the GPU does not idle while the host prepares a step.
- The scheduler thread's resolve(handle) calls PendingResult.finish(), which waits for the
  step's copy-done event and builds the host lists.

The future buffer lives on the worker's device (the CPU in CPU runs). Steps a worker runs
synchronously (logprobs, drafting steps) come back as finished PendingResults; their tokens
are written into the buffer from the host lists.

A slot is reused only after every in-flight step of the request that held it was committed, so a
placeholder always refers to the newest token of its own request.

When steps may pipeline (the scheduler's rule, see scheduler.py `step_overlap`): the in-flight
step's KV advance and token count must be known in advance (prefill chunks, plain decode,
speculative steps with every d_i = 0). Otherwise the scheduler resolves and commits the
in-flight step before building the next one.

On CUDA forwards run on the client's own stream, after waiting for an event the scheduler
thread records when it launches a step (so req_to_token writes of that step are visible).

Where the launch runs (`SGLANG_OVERLAP_THREAD`):
- `0` (the default): on the scheduler thread itself, at forward_batch_generation_async. Queuing
  a step's kernels never waits for the device, so the scheduler still prepares step N+1 while
  step N runs; what it saves is the GIL hand-over between two Python threads. On the H200 the
  scheduler and a worker thread each held the GIL for about half a millisecond per step, and
  the worker, waiting for the GIL after each CUDA call, was the step's critical path (py-spy,
  benchmark/README.md "seventh session"). Upstream SGLang made the same move: its overlap
  scheduler launches on a forward stream from the scheduler thread.
- `1`: on a dedicated worker thread (the original design, kept for comparison).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any

import torch

from sglang.srt.managers.pending_result import PendingResult
from sglang.srt.managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import env_flag
from sglang.srt.utils.h2d import int64_to_device

# Parts of a launched step's host time (TpModelWorkerClient.launch_info): resolving the input's
# future ids, the worker's launch, and writing the sampled ids into future_ids.
LAUNCH_PARTS = ("future_ids", "worker", "future_write")


def future_placeholder(future_index: int) -> int:
    """The input id that stands for the not-yet-sampled token stored at future_index."""
    return -(future_index + 1)


def resolve_future_ids(input_ids: torch.Tensor, future_ids: torch.Tensor) -> torch.Tensor:
    """Replace placeholders -(j + 1) by future_ids[j], on future_ids' device.

    input_ids: [num_tokens] int64 (any device); future_ids: [num_slots] int64.
    Returns [num_tokens] int64 on future_ids.device. No host synchronisation.
    """
    ids = input_ids.to(future_ids.device, non_blocking=True)
    idx = (-ids - 1).clamp(min=0)  # [num_tokens] int64, 0 for ordinary ids
    return torch.where(ids < 0, future_ids[idx], ids)


@dataclasses.dataclass
class _Launch:
    handle: int
    mwb: ModelWorkerBatch
    ready: Any  # torch.cuda.Event recorded by the scheduler thread, or None


class TpModelWorkerClient:
    """Asynchronous front of a model worker (TpModelWorker or EAGLEWorkerV2).

    forward_batch_generation_async(mwb) -> handle enqueues a step; resolve(handle) waits for it
    and returns its GenerationBatchResult. Handles must be resolved in launch order.
    """

    def __init__(self, worker: Any, num_future_slots: int, threaded: bool | None = None) -> None:
        """threaded: launch on a worker thread (True) or on the caller's thread (False);
        None reads SGLANG_OVERLAP_THREAD ("1" = threaded, default "0"). Raises ValueError on
        any other value of the variable."""
        self.worker = worker
        self.device = worker.device
        # [num_future_slots] int64 on the worker's device: newest sampled token of each slot
        self.future_ids = torch.zeros(num_future_slots, dtype=torch.int64, device=self.device)
        self.on_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.next_handle = 0
        self.next_to_resolve = 0
        # Host seconds of every launched step, per part of _run (launch_info): resolving the
        # future ids, the worker's launch (forward, sampling, read-back copy) and the write of
        # the sampled ids into future_ids. Why: on the H100 host the launch of a decode step
        # outside the runner's forward took 252-459 us against ~200 on the CPU machine
        # (thirty-ninth session); which part grows when a server runs host-bound tells
        # whether it waits for the device. Cost: four perf_counter calls per step.
        self.launch_seconds = dict.fromkeys(LAUNCH_PARTS, 0.0)
        self.launch_seconds_extend = dict.fromkeys(LAUNCH_PARTS, 0.0)  # prefill steps' part
        # Same-thread mode: launched steps in launch order, (handle, PendingResult or exception)
        self.launched: collections.deque[tuple[int, Any]] = collections.deque()
        self.thread: threading.Thread | None = None  # the worker thread, when threaded
        if overlap_thread_from_env() if threaded is None else threaded:
            self.input_queue: queue.Queue[_Launch | None] = queue.Queue()
            self.output_queue: queue.Queue[tuple[int, Any]] = queue.Queue()
            self.thread = threading.Thread(target=self._loop, name="tp-worker-overlap", daemon=True)
            self.thread.start()

    @property
    def pools(self) -> tuple:
        return self.worker.pools

    # ---------------------------------------------------------------- scheduler thread
    def forward_batch_generation_async(self, mwb: ModelWorkerBatch) -> int:
        """Queue one step; returns its handle (launch order). Never blocks."""
        ready = None
        if self.on_cuda:
            ready = torch.cuda.Event()
            ready.record()  # after this thread's req_to_token writes for the step
        handle = self.next_handle
        if self.thread is None:
            # KeyboardInterrupt/SystemExit (Ctrl-C; SIGTERM, whose handler calls sys.exit)
            # land on this thread and propagate from here: deferring them to resolve() would
            # have the scheduler build and launch another step before it stops. The
            # interrupted launch takes no handle.
            out = self._execute(_Launch(handle, mwb, ready), Exception)
            self.launched.append((handle, out))
        else:
            self.input_queue.put(_Launch(handle, mwb, ready))
        self.next_handle += 1
        return handle

    def resolve(self, handle: int) -> GenerationBatchResult:
        """Wait for step `handle` (the oldest unresolved one) and return its result.

        Raises ValueError when handles are resolved out of order, and re-raises any exception
        the worker thread hit while running the step.
        """
        if handle != self.next_to_resolve:
            raise ValueError(f"resolve({handle}) out of order: expected {self.next_to_resolve}")
        got, out = self.launched.popleft() if self.thread is None else self.output_queue.get()
        assert got == handle
        self.next_to_resolve += 1
        if isinstance(out, BaseException):
            raise out
        return out.finish()  # waits for the step's copy-done event (GIL released)

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Synchronous step (launch + resolve), ordered after every queued step."""
        return self.resolve(self.forward_batch_generation_async(mwb))

    def shutdown(self) -> None:
        if self.thread is not None:
            self.input_queue.put(None)
            self.thread.join()

    # ---------------------------------------------------------------- worker thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # thread-local
        if self.on_cuda:
            torch.cuda.set_device(self.device)
        while True:
            item = self.input_queue.get()
            if item is None:
                return
            # BaseException: whatever the step raises, the thread lives on to hand it over
            self.output_queue.put((item.handle, self._execute(item, BaseException)))

    def _execute(self, item: _Launch, catch: type[BaseException]) -> Any:
        """Launch one step on the client's stream: its PendingResult, or the exception of type
        `catch` it raised (handed to resolve(), which raises it on the scheduler thread)."""
        try:
            with torch.no_grad():
                if self.stream is None:
                    return self._run(item.mwb)
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(item.ready)
                    return self._run(item.mwb)
        except catch as e:
            return e

    def _run(self, mwb: ModelWorkerBatch) -> PendingResult:
        """Resolve the step's future placeholders on the device, launch it, and queue the
        write of its sampled ids into future_ids (no host synchronisation). A decode step
        right behind another (mwb.all_future_ids) gathers its input ids by request slot, and
        the same device copy of the slots indexes the write: a few device calls instead of
        a scan of the ids on the host and a dozen small ones (host time that a host-bound
        decode step pays in full)."""
        t0 = time.perf_counter()
        slots_dev = None
        if mwb.all_future_ids:
            (slots_dev,) = int64_to_device([mwb.req_pool_indices], self.device)
            mwb = dataclasses.replace(mwb, input_ids=self.future_ids[slots_dev])
        elif mwb.has_future_ids:
            mwb = dataclasses.replace(
                mwb, input_ids=resolve_future_ids(mwb.input_ids, self.future_ids)
            )
        t1 = time.perf_counter()
        pending = self.worker.forward_batch_generation_launch(mwb)
        pending.keep_alive = mwb  # its device tensors are read by this stream's queued step
        t2 = time.perf_counter()
        rows = pending.sampled_rows
        if rows:
            if slots_dev is None or len(rows) != len(mwb.req_pool_indices):
                (slots_dev,) = int64_to_device(
                    [[mwb.req_pool_indices[i] for i in rows]], self.device
                )
            if pending.next_ids_device is not None:  # queued after the step's sampling
                vals = pending.next_ids_device
            else:  # a step the worker ran synchronously
                result = pending.finish()
                (vals,) = int64_to_device([[result.next_token_ids[i] for i in rows]], self.device)
            self.future_ids[slots_dev] = vals
        parts = zip(LAUNCH_PARTS, (t1 - t0, t2 - t1, time.perf_counter() - t2), strict=True)
        extend = mwb.forward_mode == ForwardMode.EXTEND
        for part, seconds in parts:
            self.launch_seconds[part] += seconds
            if extend:
                self.launch_seconds_extend[part] += seconds
        return pending

    def launch_info(self) -> dict[str, float]:
        """{'launch_s_<part>': seconds since start} for the parts of every launched step
        (LAUNCH_PARTS; with the worker thread, that thread's time), and
        'launch_s_<part>_extend', the prefill steps' share of each. Not `host_s_*` keys:
        these are inside the scheduler's `launch` phase, not next to it."""
        out = {f"launch_s_{k}": v for k, v in self.launch_seconds.items()}
        out.update({f"launch_s_{k}_extend": v for k, v in self.launch_seconds_extend.items()})
        return out


def overlap_thread_from_env() -> bool:
    """SGLANG_OVERLAP_THREAD: "1" launches steps on a worker thread, "0" (default) on the
    scheduler thread. Raises ValueError naming the variable on any other value."""
    raw = env_flag("OVERLAP_THREAD", "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"SGLANG_OVERLAP_THREAD must be 0 or 1, got {raw!r}")
    return raw == "1"
