"""The scheduler process: owns every request, the KV pools and the prefix cache; each step it
decides what runs (a plan), has the worker execute it, and commits the result.

Loop (upstream's event_loop_normal): receive requests -> pick the next batch (prefill has
priority; otherwise one decode token per running request) -> run -> commit -> send outputs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import zmq

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.batch_builder import BatchBuilder
from sglang.srt.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.kv_planner import KVPlanner
from sglang.srt.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import INIT_NEW_TOKEN_RATIO
from sglang.srt.managers.scheduler_output_processor import OutputProcessor
from sglang.srt.managers.spec_scheduler import SpecScheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


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

    def init_memory_and_cache(self) -> None:
        self.req_to_token_pool, self.allocator = self.tp_worker.pools
        self.max_total_num_tokens = self.allocator.size
        cache_cls = ChunkCache if self.server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(self.req_to_token_pool, self.allocator)
        self.kv = KVPlanner(self.req_to_token_pool, self.allocator, self.tree_cache)

    def init_state(self) -> None:
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.spec = None if self.spec_algorithm.is_none() else SpecScheduler(self)
        self.builder = BatchBuilder(self)
        self.outputs = OutputProcessor(self)
        self.stats: dict[str, Any] = {
            "num_retractions": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "forward_steps": 0,
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
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        while True:
            if poller.poll(timeout=1000 if self.is_idle() else 0):
                self.recv_requests()
            self.step()

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
        """Run one forward step (if anything can run) and commit its results."""
        self.outputs.drop_aborted()
        batch = self.builder.get_next_batch_to_run()
        if batch is not None:
            mwb = self.builder.build_model_worker_batch(batch)
            result = self.tp_worker.forward_batch_generation(mwb)
            self.stats["forward_steps"] += 1
            self.outputs.process_batch_result(batch, result)
        self.outputs.flush()
        return batch

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
        limit = min(self.model_config.context_len, self.max_total_num_tokens - 1)
        if len(req.origin_input_ids) >= limit:
            req.finished_reason = FinishReason(
                "abort",
                message=f"the prompt has {len(req.origin_input_ids)} tokens; this server holds "
                f"at most {limit} tokens per request",
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
        for req in [*self.running, self.chunked_req]:
            if req is not None and req.rid == rid:
                req.to_abort = True

    def flush_cache(self) -> bool:
        if self.running or self.waiting_queue or self.chunked_req:
            return False
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        return True

    def internal_state(self) -> dict:
        held = self.tree_cache.total_size()
        free = self.allocator.available_size()
        used = self.max_total_num_tokens - free - self.tree_cache.evictable_size()
        prompt = max(1, self.stats["prompt_tokens"])
        return {
            "kv_pool_size": self.max_total_num_tokens,
            "kv_available_tokens": free,
            "radix_cache_tokens": held,
            "token_usage": used / self.max_total_num_tokens,
            "cache_hit_rate": self.stats["cached_tokens"] / prompt,
            "num_running_reqs": len(self.running) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting_queue),
            "new_token_ratio": self.new_token_ratio,
            **self.stats,
            **(self.spec.server_info() if self.spec is not None else {}),
        }

    def is_idle(self) -> bool:
        return not (self.waiting_queue or self.running or self.chunked_req)


def run_scheduler_process(server_args: ServerArgs, model_config: ModelConfig, port_args, pipe):
    """Entry point of the scheduler subprocess; reports readiness (or the startup error)."""
    from sglang.srt.utils.process import set_parent_death_signal

    set_parent_death_signal()
    torch.set_grad_enabled(False)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="[%(asctime)s scheduler] %(levelname)s %(message)s",
    )
    try:
        if server_args.device == "cuda":
            torch.cuda.set_device(0)
        scheduler = Scheduler(server_args, model_config, port_args)
    except Exception as e:  # reported to the parent, which raises it
        logger.exception("scheduler failed to start")
        pipe.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    pipe.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens})
    scheduler.event_loop()
