"""TpModelWorkerClient: runs the model worker on its own thread so that the scheduler can build
step N+1 on the CPU while step N runs (overlap scheduling, `--disable-overlap-schedule` off).

The client wraps a TpModelWorker or an EAGLEWorkerV2 and owns no request state: it executes
ModelWorkerBatches in the order they were launched and hands back their GenerationBatchResults
in the same order. Its only state is the future-token buffer:

- When the scheduler builds step N+1 before step N's sampled tokens are known, the input id of
  a request's last (not yet known) token is the placeholder -(future_index + 1), where
  future_index is the request's slot in the ReqToTokenPool (`future_placeholder`).
- Right after step N samples, the worker thread writes each sampled request's token into
  future_ids[req_pool_index].
- Before step N+1 runs, the worker thread replaces placeholders in its input ids
  (`resolve_future_ids`, a torch.where): the scheduler thread never waits for step N for this.

Where the future buffer lives: the workers return sampled ids as host lists and the CUDA-graph
runner packs host input ids into its one host-to-device copy, so by default the buffer is on the
host (the worker thread already holds step N's ids when it starts step N+1: no extra sync).
With `resolve_on_device=True` the buffer is on the device and placeholders are resolved there
(input ids then reach the worker as a device tensor, which the eager path accepts).

A slot is reused only after every in-flight step of the request that held it was committed, so a
placeholder always refers to the newest token of its own request.

When steps may pipeline (the scheduler's rule, see scheduler.py `step_overlap`): the in-flight
step's KV advance and token count must be known in advance (prefill chunks, plain decode,
speculative steps with every d_i = 0). Otherwise the scheduler resolves and commits the
in-flight step before building the next one.

On CUDA the thread runs forwards on its own stream, after waiting for an event the scheduler
thread records when it launches a step (so req_to_token writes of that step are visible).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any

import torch

from sglang.srt.managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch


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

    def __init__(self, worker: Any, num_future_slots: int, resolve_on_device: bool = False) -> None:
        self.worker = worker
        self.device = worker.device
        # [num_future_slots] int64: newest sampled token of each request slot
        self.future_ids = torch.zeros(
            num_future_slots,
            dtype=torch.int64,
            device=self.device if resolve_on_device else torch.device("cpu"),
        )
        self.on_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.input_queue: queue.Queue[_Launch | None] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.next_handle = 0
        self.next_to_resolve = 0
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
        self.next_handle += 1
        self.input_queue.put(_Launch(handle, mwb, ready))
        return handle

    def resolve(self, handle: int) -> GenerationBatchResult:
        """Wait for step `handle` (the oldest unresolved one) and return its result.

        Raises ValueError when handles are resolved out of order, and re-raises any exception
        the worker thread hit while running the step.
        """
        if handle != self.next_to_resolve:
            raise ValueError(f"resolve({handle}) out of order: expected {self.next_to_resolve}")
        got, out = self.output_queue.get()
        assert got == handle
        self.next_to_resolve += 1
        if isinstance(out, BaseException):
            raise out
        return out

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Synchronous step (launch + resolve), ordered after every queued step."""
        return self.resolve(self.forward_batch_generation_async(mwb))

    def shutdown(self) -> None:
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
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(item.ready)
                        out: Any = self._run(item.mwb)
                else:
                    out = self._run(item.mwb)
            except BaseException as e:  # handed to the scheduler thread, which raises it
                out = e
            self.output_queue.put((item.handle, out))

    def _run(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        if bool((mwb.input_ids < 0).any()):  # CPU tensor: no device sync
            mwb = dataclasses.replace(
                mwb, input_ids=resolve_future_ids(mwb.input_ids, self.future_ids)
            )
        result = self.worker.forward_batch_generation(mwb)
        slots, toks = [], []
        for slot, tok in zip(mwb.req_pool_indices, result.next_token_ids, strict=True):
            if tok is not None:
                slots.append(slot)
                toks.append(tok)
        if slots:
            dev = self.future_ids.device
            idx = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
            val = torch.tensor(toks, dtype=torch.int64).to(dev, non_blocking=True)
            self.future_ids[idx] = val
        return result
