"""The scheduler process: owns every request, the KV pools and the prefix cache; each step it
decides what runs (a plan), has the worker execute it, and commits the result.

Loop (upstream's event_loop_normal): receive requests -> pick the next batch (prefill has
priority; otherwise one decode token per running request) -> run -> commit -> send outputs.

Overlap loop (event_loop_overlap, default on CUDA; `--disable-overlap-schedule` turns it off):
receive -> build step N+1 -> launch it on the worker thread -> resolve and commit step N -> send
outputs. Step N+1 is built before step N's tokens are known; it pipelines only when step N's KV
advance is known in advance:

- step N is a prefill (chunks included), a plain decode, or a speculative step where every
  d_i = 0 (each request gains exactly one token and one KV position);
- step N+1 does not draft, does not apply penalties (repetition/frequency/presence read the
  unknown token's value on the CPU) to a request of step N, and needs no retraction;
- no prompt chunk is in flight when N+1 is a prefill (one chunked request at a time).

Otherwise the scheduler first resolves and commits step N (`drain`, which sends its outputs at
once), then builds. Step N+1 refers to a request's unknown last token by a future placeholder
that the worker thread resolves from its future-token buffer (tp_worker_overlap_thread.py).
Commits stay in step order and all request state (output ids, kv_len, draft state, KV
slots) stays here: a request that finishes in step N while in step N+1 loses N+1's token and
slots when N+1 commits; a request whose in-flight token reaches max_new_tokens is not
scheduled again; sampling counts the in-flight token, so random positions (and outputs) equal
the non-overlap run's.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.batch_builder import BatchBuilder
from sglang.srt.managers.host_phases import HostPhases
from sglang.srt.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.kv_planner import KVPlanner
from sglang.srt.managers.request_validation import ContextLengthError, check_prompt_fits
from sglang.srt.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import INIT_NEW_TOKEN_RATIO
from sglang.srt.managers.scheduler_output_processor import OutputProcessor
from sglang.srt.managers.spec_scheduler import SpecScheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.tp_worker_overlap_thread import TpModelWorkerClient
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils.gc_stats import process_gc_timer
from sglang.srt.utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class InflightStep:
    """A step launched on the worker thread and not committed yet (overlap scheduling)."""

    batch: ScheduleBatch
    handle: int


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, port_args=None) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.init_worker()
        self.init_memory_and_cache()
        self.init_state()
        self.init_ipc(port_args)

    # ---------------------------------------------------------------- init
    def init_worker(self) -> None:
        self.spec_algorithm = SpeculativeAlgorithm.from_string(
            self.server_args.speculative_algorithm
        )
        if self.spec_algorithm.is_none():
            self.tp_worker = TpModelWorker(self.model_config, self.server_args)
        else:
            from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

            self.tp_worker = EAGLEWorkerV2(self.model_config, self.server_args)
        self.tokenizer = get_tokenizer(self.server_args.tokenizer_path)
        disable = self.server_args.disable_overlap_schedule
        if disable is None:  # unresolved ServerArgs: the resolver's default
            disable = self.server_args.device != "cuda"
        self.enable_overlap = not disable
        self.worker_client: TpModelWorkerClient | None = None
        self.inflight: InflightStep | None = None

    def init_memory_and_cache(self) -> None:
        self.req_to_token_pool, self.allocator = self.tp_worker.pools
        self.max_total_num_tokens = self.allocator.size
        cache_cls = ChunkCache if self.server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(self.req_to_token_pool, self.allocator)
        self.kv = KVPlanner(self.req_to_token_pool, self.allocator, self.tree_cache)
        if self.enable_overlap:  # future token ids are indexed by request slot
            self.worker_client = TpModelWorkerClient(self.tp_worker, self.req_to_token_pool.size)

    def init_state(self) -> None:
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.spec = None if self.spec_algorithm.is_none() else SpecScheduler(self)
        self.builder = BatchBuilder(self)
        self.outputs = OutputProcessor(self)
        self.phases = HostPhases()  # scheduler-thread seconds per loop phase (host_s_* keys)
        process_gc_timer()  # the process's garbage-collector time from now on (gc_s_* keys)
        self.stats: dict[str, Any] = {
            "num_retractions": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "forward_steps": 0,
            # prefill (extend) steps launched, the requests they took (a chunk counts each
            # step) and the tokens they computed: how finely arrivals were batched
            "prefill_steps": 0,
            "prefill_reqs": 0,
            "prefill_tokens": 0,
            "overlap_pipelined_steps": 0,  # launched while the previous step was in flight
            "overlap_drains": 0,  # in-flight step committed early because the next could not
            "overlap_discarded_tokens": 0,  # tokens of requests that finished a step earlier
        }

    def init_ipc(self, port_args) -> None:
        self.recv_from_tokenizer = self.send_to_tokenizer = None
        if port_args is None:
            return
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = ctx.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc)
        self.send_to_tokenizer = ctx.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc)

    # ---------------------------------------------------------------- loop
    def event_loop(self) -> None:
        """Serve forever: receive, step, send (overlapped when enable_overlap)."""
        if self.enable_overlap:
            return self.event_loop_overlap()
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        while True:
            self.poll_requests(poller)
            self.step()

    def event_loop_overlap(self) -> None:
        """Serve forever with overlap: each iteration builds and launches step N+1, then
        commits step N (see the module docstring)."""
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        while True:
            self.poll_requests(poller)
            self.step_overlap()

    def poll_requests(self, poller: zmq.Poller) -> None:
        """Receive what arrived (waiting up to 1 s when idle). Busy time counts as the `recv`
        host phase; an idle wait does not."""
        if self.is_idle():
            if poller.poll(timeout=1000):
                self.recv_requests()
            return
        t = self.phases.mark()
        if poller.poll(timeout=0):
            self.recv_requests()
        self.phases.add("recv", t)

    def recv_requests(self) -> None:
        while True:
            try:
                msg = self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self.handle_message(msg)
            if reply is not None:
                self.send(reply)

    def send(self, obj: Any) -> None:
        if self.send_to_tokenizer is not None:
            self.send_to_tokenizer.send_pyobj(obj)
        else:
            self.outputs.local_outbox.append(obj)

    def handle_message(self, msg: Any) -> Any:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            return FlushCacheReqOutput(success=self.flush_cache())
        elif isinstance(msg, GetInternalStateReq):
            return GetInternalStateReqOutput(state=self.internal_state())
        else:
            logger.error("scheduler got an unknown message %r", type(msg))
        return None

    def step(self) -> ScheduleBatch | None:
        """Run one forward step (if anything can run) and commit its results. With overlap:
        launch the next step and commit the previous one (step_overlap). Returns the batch
        launched by this call, or None."""
        if self.enable_overlap:
            return self.step_overlap()
        ph = self.phases
        t = ph.mark()
        self.outputs.drop_aborted()
        batch = self.builder.get_next_batch_to_run()
        ext = batch is not None and batch.forward_mode == ForwardMode.EXTEND
        t = ph.add("plan", t, ext)
        if batch is not None:
            mwb = self.builder.build_model_worker_batch(batch)
            self.outputs.on_launch(batch)
            batch.step_index = self.stats["forward_steps"]
            t = ph.add("build", t, ext)
            result = self.tp_worker.forward_batch_generation(mwb)
            self.stats["forward_steps"] += 1
            t = ph.add("launch", t, ext)
            self.outputs.process_batch_result(batch, result)
            t = ph.add("commit", t, ext)
        self.outputs.flush()
        ph.add("flush", t)
        return batch

    def step_overlap(self) -> ScheduleBatch | None:
        """Build and launch step N+1 (draining step N first when they cannot pipeline), then
        resolve and commit step N. Returns the batch launched by this call, or None."""
        ph = self.phases
        t = ph.mark()
        self.outputs.drop_aborted()
        if (
            self.inflight is not None
            and self.inflight.batch.forward_mode == ForwardMode.TARGET_VERIFY
        ):
            self.drain()  # a drafting step's KV advance is known only once it is verified
        batch = self.builder.get_next_batch_to_run()  # may drain (BatchBuilder.get_decode_batch)
        ext = batch is not None and batch.forward_mode == ForwardMode.EXTEND
        t = ph.add("plan", t, ext)
        prev, self.inflight = self.inflight, None
        if batch is not None:
            mwb = self.builder.build_model_worker_batch(batch)
            self.outputs.on_launch(batch)
            batch.step_index = self.stats["forward_steps"]
            t = ph.add("build", t, ext)
            self.inflight = InflightStep(
                batch, self.worker_client.forward_batch_generation_async(mwb)
            )
            self.stats["forward_steps"] += 1
            self.stats["overlap_pipelined_steps"] += prev is not None
            t = ph.add("launch", t, ext)
        if prev is not None:
            self.commit(prev)
            t = ph.mark()
        self.outputs.flush()
        ph.add("flush", t)
        return batch

    def drain(self) -> None:
        """Resolve and commit the in-flight step, if any (overlap scheduling), and send its
        outputs at once: the next step's launch comes before step_overlap's own flush, and a
        drain happens before a drafting step, whose launch (draft catch-up, draft steps,
        verify) takes longest. Holding the outputs until after it would add that launch to
        the drained step's latency, e.g. to a new request's first token when its first
        decode step drafts."""
        step, self.inflight = self.inflight, None
        if step is not None:
            self.stats["overlap_drains"] += 1
            self.commit(step)
            t = self.phases.mark()
            self.outputs.flush()
            self.phases.add_nested("flush", t)

    def commit(self, step: InflightStep) -> None:
        """Resolve and commit an in-flight step (host phases `resolve` and `commit`, also when
        a drain runs it inside the `plan` phase)."""
        t = self.phases.mark()
        result = self.worker_client.resolve(step.handle)
        t = self.phases.add_nested("resolve", t)
        self.outputs.process_batch_result(step.batch, result)
        self.phases.add_nested("commit", t, step.batch.forward_mode == ForwardMode.EXTEND)

    # ---------------------------------------------------------------- requests
    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            seed=msg.seed,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            stream=msg.stream,
            input_text=msg.input_text,
        )
        self.outputs.init_detokenizer(req)
        if self.spec is not None:
            self.spec.on_new_request(req)
        try:  # the tokenizer manager checked the same rule; kept for direct senders
            check_prompt_fits(
                len(req.origin_input_ids), self.model_config.context_len, self.max_total_num_tokens
            )
        except ContextLengthError as e:
            req.finished_reason = FinishReason("abort", message=str(e))
            self.outputs.emit(req)
            return
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.waiting_queue) >= limit:
            # upstream's rule: the waiting queue holds at most --max-queued-requests requests
            # (whatever keeps them waiting: running slots, KV or the prefill budget); the
            # tokenizer manager answers this abort with HTTP 503
            req.finished_reason = FinishReason(
                "abort",
                message=f"the waiting queue is full (--max-queued-requests {limit}); retry later",
                status_code=503,
            )
            self.outputs.emit(req)
            return
        self.waiting_queue.append(req)

    def abort_request(self, rid: str) -> None:
        for req in self.waiting_queue:
            if req.rid == rid:
                self.waiting_queue.remove(req)
                req.finished_reason = FinishReason("abort", message="aborted by request")
                self.outputs.emit(req)
                return
        inflight = self.inflight.batch.reqs if self.inflight is not None else []
        for req in [*self.running, self.chunked_req, *inflight]:
            if req is not None and req.rid == rid and not req.finished():
                req.to_abort = True  # dropped by the next step (once it is running again)

    def flush_cache(self) -> bool:
        if self.running or self.waiting_queue or self.chunked_req or self.inflight:
            return False
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        return True

    def internal_state(self) -> dict:
        """Scheduler state for /get_server_info and /metrics. KV accounting as upstream's
        Scheduler._get_token_info: num_used_tokens = pool - available - evictable prefix cache
        (slots held by requests; cache that eviction could free is not "used") and
        token_usage = num_used_tokens / pool."""
        held = self.tree_cache.total_size()
        free = self.allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        used = self.max_total_num_tokens - free - evictable
        prompt = max(1, self.stats["prompt_tokens"])
        return {
            "kv_pool_size": self.max_total_num_tokens,
            "kv_available_tokens": free,
            "kv_evictable_tokens": evictable,
            "radix_cache_tokens": held,
            "num_used_tokens": used,
            "token_usage": used / self.max_total_num_tokens,
            "cache_hit_rate": self.stats["cached_tokens"] / prompt,
            "num_running_reqs": len(self.running) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting_queue),
            "new_token_ratio": self.new_token_ratio,
            **self.runtime_config(),
            **self.stats,
            **self.phases.info(),
            **self.tp_worker.model_runner.forward_counters.info(),
            **(self.worker_client.launch_info() if self.worker_client is not None else {}),
            **process_gc_timer().info(),
            **(self.spec.server_info() if self.spec is not None else {}),
        }

    def runtime_config(self) -> dict:
        """What the flags resolved to on this machine (the flags themselves may say None)."""
        runner = self.tp_worker.model_runner
        graphs = runner.cuda_graph_runner
        return {
            "attention_backend": runner.attention_backend_name,
            "cuda_graph_bs": list(graphs.batch_sizes) if graphs is not None else [],
            "overlap_schedule": self.enable_overlap,
            "cpu_threads": torch.get_num_threads(),  # torch's intra-op pool in this process
        }

    def is_idle(self) -> bool:
        return not (self.waiting_queue or self.running or self.chunked_req or self.inflight)


def run_scheduler_process(server_args: ServerArgs, model_config: ModelConfig, port_args, pipe):
    """Entry point of the scheduler subprocess; reports readiness (or the startup error)."""
    from sglang.srt.utils.process import (
        SCHEDULER_PROCESS_NAME,
        apply_gil_switch_interval,
        freeze_gc,
        set_parent_death_signal,
        set_process_name,
    )

    set_parent_death_signal()
    set_process_name(SCHEDULER_PROCESS_NAME)
    # SIGTERM (Engine.shutdown, the server's exit) ends the process through SystemExit, so
    # multiprocessing finalizers run (tqdm's lock semaphore is unlinked instead of reported
    # as leaked by the parent's resource tracker).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    torch.set_grad_enabled(False)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="[%(asctime)s scheduler] %(levelname)s %(message)s",
    )
    try:
        apply_gil_switch_interval()  # a bad value is reported like any start-up error
        if server_args.device == "cuda":
            torch.cuda.set_device(0)
        scheduler = Scheduler(server_args, model_config, port_args)
    except Exception as e:  # reported to the parent, which raises it
        logger.exception("scheduler failed to start")
        pipe.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    freeze_gc("scheduler")
    process_gc_timer().reset()  # gc_* keys count collections while serving, not freeze_gc's
    pipe.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens})
    try:
        scheduler.event_loop()
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C reaches the process group; SIGTERM
        pass
