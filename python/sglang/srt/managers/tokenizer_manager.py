"""TokenizerManager: runs in the main process (HTTP server or Engine). Validates and tokenizes
requests, sends them to the scheduler over ZMQ, and turns the scheduler's BatchStrOut messages
into upstream-style output dicts (the output side is in tokenizer_output)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    new_rid,
)
from sglang.srt.managers.request_expansion import (
    choice_groups,
    expand_request,
    num_choices,
)
from sglang.srt.managers.request_validation import (
    build_sampling_params,
    check_logprob_params,
    check_prompt_length,
    check_text_size,
    max_token_chars,
)
from sglang.srt.managers.tokenizer_output import (
    ReqState,
    TokenTextCache,
    build_output,
    close_all,
    full_meta,
    handle_batch_out,
    observe_finished,
)
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)
# Prompt texts longer than this (characters, a request's texts together) are tokenized on a
# worker thread (TokenizerManager.off_loop), so the HTTP event loop keeps serving meanwhile:
# the fast tokenizer releases the GIL while it encodes, and a text just under
# check_text_size's bound (2.6M characters for SmolLM2) takes seconds to encode, e.g. 4.7 s
# for 1M emoji on the CPU machine. Shorter texts stay on the loop (a thread hop costs ~50 us).
OFF_LOOP_TOKENIZE_CHARS = 1 << 16


class QueueFullError(RuntimeError):
    """Raised when --max-queued-requests requests are already waiting (HTTP 503)."""

    code = "queue_full"


class ServerClosingError(RuntimeError):
    """Raised for a request this server will not finish because it is stopping (HTTP 503,
    code server_shutting_down; the client may retry elsewhere or later): one that arrives
    after shutdown began, or one in flight that had nothing streamed yet (a non-streamed
    request gets its output only at its end, which it will not reach)."""

    code = "server_shutting_down"


class TokenizerManager:
    # finish_all_local's message once it ran: the server is stopping, new requests get a 503
    closing: str | None = None

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, port_args) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.served_model_name = server_args.served_model_name
        self.tokenizer = get_tokenizer(server_args.tokenizer_path, server_args.chat_template)
        self.chars_per_token = max_token_chars(self.tokenizer)  # check_text_size's bound
        self.port_args = port_args
        # In-flight requests: added by _submit, updated by tokenizer_output.handle_batch_out,
        # removed by generate_request's exit or (abandoned ones) by handle_batch_out.
        self.rid_to_state: dict[str, ReqState] = {}
        # The client's rid of a request with n > 1 -> its choices' rids (choice_rid): added
        # and removed by generate_request, so that the client's rid is in flight too and
        # abort_request(rid) aborts every choice.
        self.rid_groups: dict[str, list[str]] = {}
        # token id -> text for return_text_in_logprobs (cached per id, at most the vocabulary)
        self._token_text = TokenTextCache(self.tokenizer)
        self.rng = random.Random(server_args.random_seed)
        # a TokenizerMetricsCollector, set by http_server with --enable-metrics; None: not observed
        self.metrics_collector: Any = None
        self.max_total_num_tokens: int | None = None
        self._sockets_ready = False
        self._pending_replies: dict[type, list[asyncio.Future]] = {}
        self._handle_task: asyncio.Task | None = None

    # ---------------------------------------------------------------- ipc
    def _init_sockets(self) -> None:
        ctx = zmq.asyncio.Context(2)
        self.recv_from_scheduler = ctx.socket(zmq.PULL)
        self.recv_from_scheduler.bind(self.port_args.tokenizer_ipc)
        self.send_to_scheduler = ctx.socket(zmq.PUSH)
        self.send_to_scheduler.connect(self.port_args.scheduler_input_ipc)
        self._sockets_ready = True

    def _ensure_handle_loop(self) -> None:
        if not self._sockets_ready:
            self._init_sockets()
        if self._handle_task is None or self._handle_task.done():
            self._handle_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_scheduler.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                try:
                    self._handle_batch_out(msg)
                except Exception:  # noqa: BLE001 - this loop delivers every request's outputs
                    logger.exception("error while handling the scheduler's outputs")
            else:
                # A waiter that gave up (e.g. /get_server_info timed out during a long prefill)
                # left a cancelled future: skip it, so the late reply neither raises out of this
                # loop (which delivers every request's outputs) nor answers the next caller.
                waiters = self._pending_replies.get(type(msg), [])
                while waiters and waiters[0].done():
                    waiters.pop(0)
                if waiters:
                    waiters.pop(0).set_result(msg)

    def _send(self, obj: Any) -> None:
        self.send_to_scheduler.send_pyobj(obj)

    async def _ask(self, req: Any, reply_type: type) -> Any:
        self._ensure_handle_loop()
        fut = asyncio.get_running_loop().create_future()
        self._pending_replies.setdefault(reply_type, []).append(fut)
        self._send(req)
        return await fut

    # ---------------------------------------------------------------- generate
    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict | list[dict]]:
        """Yield outputs of one request or a batch (see upstream /generate semantics)."""
        self._ensure_handle_loop()
        singles = self._expand(obj)
        chars = sum(len(o.text) for o in singles if isinstance(o.text, str))
        # validates all before sending any
        tokenized = await self.off_loop(lambda: [self._tokenize(o) for o in singles], chars)
        rids = [t.rid for t in tokenized]
        groups = choice_groups(obj)
        named = rids + list(groups)
        if len(set(named)) < len(named):
            dup = next(r for r in named if named.count(r) > 1)
            raise ValueError(f"'rid' {dup!r} appears more than once in the batch")
        for rid in named:  # before any is sent: a refused batch leaves nothing behind
            if rid in self.rid_to_state or rid in self.rid_groups:
                raise ValueError(f"'rid' {rid!r} is already in flight (duplicate request id)")
        if self.closing:
            raise ServerClosingError(self.closing)
        self._check_queue(len(tokenized))
        for o, t in zip(singles, tokenized, strict=True):
            self._submit(t, text_in_logprobs=bool(o.return_text_in_logprobs))
        self.rid_groups.update(groups)
        try:
            if len(rids) == 1 and obj.is_single() and not num_choices(obj) > 1:
                async for out in self._wait_one(rids[0], obj.stream):
                    yield out
            elif obj.stream:
                async for out in self._wait_many_stream(rids):
                    yield out
            else:
                yield [await self._final(r) for r in rids]
        finally:
            for rid in groups:
                self.rid_groups.pop(rid, None)
            for rid in rids:
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue
                if state.finished:
                    del self.rid_to_state[rid]
                    continue
                state.abandoned = True  # removed when the scheduler's final output arrives
                self._send(AbortReq(rid))
                # The client left: count the request and the tokens it got, as a request
                # aborted through /abort_request is (its state waits for the abort).
                self._observe_finished(state, time.perf_counter())

    def _expand(self, obj: GenerateReqInput) -> list[GenerateReqInput]:
        """request_expansion.expand_request (a method, so that tests can stub it)."""
        return expand_request(obj)

    async def off_loop(self, fn: Any, chars: int) -> Any:
        """fn() (tokenization of prompt texts of `chars` characters in all), on a worker
        thread when chars > OFF_LOOP_TOKENIZE_CHARS, else here on the event loop. Exceptions
        propagate as from fn()."""
        if chars > OFF_LOOP_TOKENIZE_CHARS:
            return await asyncio.to_thread(fn)
        return fn()

    def check_text_size(self, text: str, param: str) -> None:
        """Refuse a prompt text too long for the context before tokenizing it
        (request_validation.check_text_size); param: the request field it came from."""
        check_text_size(len(text), self.model_config.context_len, self.chars_per_token, param)

    def _tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        if obj.input_ids is not None:
            ids = obj.input_ids
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("'input_ids' must be a list of integers")
            bad = [t for t in ids if t < 0 or t >= self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"'input_ids' has token ids outside [0, {self.model_config.vocab_size}): "
                    f"{bad[:5]}"
                )
            text = None
        elif isinstance(obj.text, str):
            text = obj.text
            self.check_text_size(text, "prompt")
            ids = self.tokenizer.encode(text)
        else:
            raise ValueError("'text' must be a string or a list of strings")
        if len(ids) == 0:
            raise ValueError("the prompt is empty: give a non-empty 'text' or 'input_ids'")
        sp = build_sampling_params(obj.sampling_params, self.tokenizer, self.model_config)
        given = isinstance(obj.sampling_params, dict) and (
            obj.sampling_params.get("max_new_tokens") is not None
        )
        if not given:  # upstream: an unspecified limit is clamped to what the context allows
            sp.max_new_tokens = max(
                0, min(sp.max_new_tokens, self.model_config.context_len - len(ids))
            )
        check_prompt_length(len(ids), sp, self.model_config.context_len, self.max_total_num_tokens)
        start = check_logprob_params(
            bool(obj.return_logprob), obj.logprob_start_len, obj.top_logprobs_num, len(ids)
        )
        seed = sp.sampling_seed if sp.sampling_seed is not None else self.rng.getrandbits(62)
        return TokenizedGenerateReqInput(
            rid=obj.rid if isinstance(obj.rid, str) else new_rid(),
            input_text=text,
            input_ids=list(ids),
            sampling_params=sp,
            return_logprob=bool(obj.return_logprob),
            logprob_start_len=start,
            top_logprobs_num=obj.top_logprobs_num,
            stream=bool(obj.stream),
            seed=seed,
        )

    def _check_queue(self, adding: int) -> None:
        """Early refusal (QueueFullError) when the requests in flight beyond the running
        batch's capacity already exceed --max-queued-requests. This counts only what the
        running-request limit keeps waiting; the scheduler applies the exact bound to its
        waiting queue (requests kept waiting by KV memory or the prefill budget too) and its
        refusals come back as aborts with status_code 503 (_wait_one raises them)."""
        limit = self.server_args.max_queued_requests
        # Requests beyond the running batch's capacity wait in the scheduler's queue.
        waiting = len(self.rid_to_state) + adding - self.server_args.max_running_requests
        if limit is not None and waiting > limit:
            raise QueueFullError(
                f"the waiting queue is full (--max-queued-requests {limit}, "
                f"{len(self.rid_to_state)} requests in flight); retry later"
            )

    def _submit(self, t: TokenizedGenerateReqInput, text_in_logprobs: bool = False) -> None:
        if t.rid in self.rid_to_state:
            raise ValueError(f"'rid' {t.rid!r} is already in flight (duplicate request id)")
        self.rid_to_state[t.rid] = ReqState(
            t.rid, len(t.input_ids), t.return_logprob, text_in_logprobs=text_in_logprobs
        )
        if self.server_args.log_requests:
            logger.info("request %s: %d prompt tokens", t.rid, len(t.input_ids))
        self._send(t)

    async def _wait_one(self, rid: str, stream: bool) -> AsyncIterator[dict]:
        state = self.rid_to_state[rid]
        yielded = False
        while True:
            await state.event.wait()
            state.event.clear()
            # Read `finished` once: the request may finish while this generator is suspended
            # at the yield below; its final output must then still be yielded (the event is
            # set again, so the next iteration does), not dropped by a re-read after it.
            finished = state.finished
            if finished and state.closed and not yielded:  # finish_all_local, nothing sent
                raise ServerClosingError(state.meta["finish_reason"]["message"])
            if stream or finished:
                out = self._output(state)
                reason = out["meta_info"].get("finish_reason") or {}
                if finished and reason.get("status_code") == 503:  # the scheduler's full queue
                    raise QueueFullError(reason.get("message", ""))
                yielded = True
                yield out
            if finished:
                return

    async def _final(self, rid: str) -> dict:
        async for out in self._wait_one(rid, stream=False):
            return out
        raise RuntimeError("unreachable")

    async def _wait_many_stream(self, rids: list[str]) -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rid: str) -> None:
            try:
                async for out in self._wait_one(rid, stream=True):
                    out["meta_info"]["index"] = i
                    out["index"] = i
                    await queue.put(out)
            except Exception as e:  # noqa: BLE001 - raised by the consumer below
                await queue.put(e)  # (a choice refused with a 503 would else hang the stream)
                return
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(rids)]
        try:
            remaining = len(rids)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    # ---------------------------------------------------------------- outputs
    # The output side lives in tokenizer_output; these delegate to it with this manager's state.
    def _handle_batch_out(self, msg: BatchStrOut) -> None:
        handle_batch_out(self.rid_to_state, msg, self.metrics_collector)

    def _observe_finished(self, state: ReqState, now: float) -> None:
        observe_finished(state, now, self.metrics_collector)

    full_meta = staticmethod(full_meta)

    def _output(self, state: ReqState) -> dict:
        return build_output(state, self._token_text if state.text_in_logprobs else None)

    # ---------------------------------------------------------------- control
    def abort_request(self, rid: str) -> None:
        """Abort the request `rid` in flight (every choice of a request with n > 1 when rid is
        the client's id of it); an unknown or finished rid is ignored, as upstream does."""
        if not self._sockets_ready:
            return
        for r in self.rid_groups.get(rid, [rid]):
            if r in self.rid_to_state:
                self._send(AbortReq(r))

    def abort_all(self) -> int:
        """Abort every request in flight (upstream's AbortReq(abort_all=True)); each finishes
        with finish_reason abort like one aborted by rid. Returns how many were aborted."""
        rids = list(self.rid_to_state)
        for rid in rids:
            self.abort_request(rid)
        return len(rids)

    def finish_all_local(self, message: str) -> int:
        """End every request in flight on this side alone, without waiting for the scheduler
        (tokenizer_output.close_all): a stream that has sent something sends its last chunk,
        finish_reason abort, and [DONE]; a request with nothing sent yet, which is every
        non-streamed one (the scheduler sends its output at the end), fails with
        ServerClosingError (HTTP 503, so its client can retry), as does every request arriving
        afterwards. For shutdown: the HTTP server calls it when uvicorn begins to stop, before
        the scheduler is stopped (which frees the KV with the process). Returns how many
        requests were ended."""
        self.closing = message  # from now on generate_request refuses with a 503
        return close_all(self.rid_to_state, message, self.metrics_collector)

    async def flush_cache(self) -> bool:
        out: FlushCacheReqOutput = await self._ask(FlushCacheReq(), FlushCacheReqOutput)
        return out.success

    async def get_internal_state(self) -> dict:
        out: GetInternalStateReqOutput = await self._ask(
            GetInternalStateReq(), GetInternalStateReqOutput
        )
        return out.state
