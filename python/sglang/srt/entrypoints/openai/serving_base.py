"""The engine driver every OpenAI-compatible endpoint shares, and their common helpers.

The driver (`generate_once`, `open_stream`) runs TokenizerManager.generate_request for one HTTP
request: it gives the request ids, maps engine exceptions to OpenAI errors (ValueError -> 400,
QueueFullError -> 503), and aborts the request (freeing its KV) when the client disconnects.
For streams it pulls the first output before the response starts, so invalid requests still
get a proper 4xx status instead of an error inside a 200 stream; `guard_client_gone` answers a
route whose client left with an empty 499 (native /generate uses the driver and guard too). The
helpers check the model name and max_tokens, build the engine request, and shape usage and
finish reasons.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from sglang.srt.entrypoints.openai.errors import (
    OpenAIError,
    error_body,
    from_engine_exception,
    unavailable_error,
)
from sglang.srt.entrypoints.openai.protocol import SamplingFields
from sglang.srt.managers.io_struct import GenerateReqInput, new_rid
from sglang.srt.managers.request_validation import (
    ContextLengthError,
    check_max_new_tokens,
    check_prompt_fits,
)

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


# ---- engine driver ---------------------------------------------------------------------------
def assign_rids(obj: GenerateReqInput) -> list[str]:
    """Give every request of `obj` an id (keeping user-given ones); return them all."""
    if obj.is_single():
        if obj.rid is None:
            obj.rid = new_rid()
        return [obj.rid] if isinstance(obj.rid, str) else list(obj.rid)
    if obj.rid is None:
        obj.rid = [new_rid() for _ in range(obj.batch_size())]
    return list(obj.rid)


def _abort_all(tm: Any, rids: set[str]) -> None:
    for rid in rids:
        tm.abort_request(rid)


def _ids_in(out: Any) -> set[str]:
    items = out if isinstance(out, list) else [out]
    return {
        o["meta_info"]["id"]
        for o in items
        if isinstance(o, dict) and "id" in o.get("meta_info", {})
    }


async def _await_or_disconnect(request: Request | None, aw: Any) -> Any:
    """Await `aw`; if the HTTP client goes away first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


class ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


async def guard_client_gone(coro: Any) -> Any:
    """Await a route's handler; a client that left gets an empty 499 (nobody reads it)."""
    try:
        return await coro
    except ClientGone:
        return Response(status_code=499)


async def generate_once(
    tm: Any,
    obj: GenerateReqInput,
    request: Request | None,
    max_tokens_field: str = "max_new_tokens",
) -> Any:
    """Run a non-streaming request; return the TM's last output (a dict, or a list of dicts).

    Raises OpenAIError (400/503) for invalid input or a full queue (an output budget beyond the
    context names `max_tokens_field`); ClientGone when the client disconnected (the request is
    then aborted).
    """
    rids = set(assign_rids(obj))
    agen = tm.generate_request(obj)

    async def drain() -> Any:
        last = None
        async for out in agen:
            rids.update(_ids_in(out))
            last = out
        return last

    finished = False
    try:
        result = await _await_or_disconnect(request, drain())
        finished = True
        return result
    except (ClientGone, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - mapped or re-raised
        finished = True
        raise from_engine_exception(e, max_tokens_field) from e
    finally:
        if not finished:
            _abort_all(tm, rids)


class EngineStream:
    """An opened streaming request: iterate it for the TM's outputs (first one included).

    Leaving the iteration early (client disconnect cancels the response task) aborts every
    request id seen, so the scheduler frees their KV.
    """

    def __init__(self, tm: Any, agen: AsyncIterator, first: Any, rids: set[str]) -> None:
        self.tm = tm
        self.agen = agen
        self.first = first
        self.rids = rids

    async def __aiter__(self) -> AsyncIterator[Any]:
        finished = False
        try:
            if self.first is not None:
                yield self.first
            async for out in self.agen:
                self.rids.update(_ids_in(out))
                yield out
            finished = True
        finally:
            if not finished:
                _abort_all(self.tm, self.rids)


async def open_stream(
    tm: Any,
    obj: GenerateReqInput,
    request: Request | None,
    max_tokens_field: str = "max_new_tokens",
) -> EngineStream:
    """Start a streaming request and wait for its first output. Raises what generate_once
    raises (ClientGone when the client left before the first output; the request is aborted)."""
    rids = set(assign_rids(obj))
    agen = tm.generate_request(obj)
    first = None
    ok = False
    try:
        first = await _await_or_disconnect(request, agen.__anext__())
        rids.update(_ids_in(first))
        ok = True
    except StopAsyncIteration:
        ok = True
    except (ClientGone, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001
        ok = True
        raise from_engine_exception(e, max_tokens_field) from e
    finally:
        if not ok:
            _abort_all(tm, rids)
    return EngineStream(tm, agen, first, rids)


def sse(data: Any) -> bytes:
    """One server-sent-events frame."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_frames(chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """Frame each chunk as SSE, then [DONE]; an engine error mid-stream becomes an error frame."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except OpenAIError as e:
        yield sse(error_body(e.message, e.status, e.param, e.code))
    except (ValueError, RuntimeError) as e:
        err = unavailable_error(e)  # a choice refused with a 503; anything else is a 500
        if err is not None:
            yield sse(error_body(err.message, err.status, err.param, err.code))
        else:
            yield sse(error_body(str(e), 500))
    yield SSE_DONE


# ---- shared OpenAI helpers -------------------------------------------------------------------
IGNORED_NAMES_SHOWN = 10  # names listed per warning (the rest are counted)
IGNORED_NAME_CHARS = 64  # a longer name is cut
_warned_ignored: OrderedDict[tuple[str, frozenset], None] = OrderedDict()  # LRU of warned sets


def warn_ignored_fields(req: SamplingFields, route: str, remember: int = 256) -> None:
    """Log a warning naming the top-level fields of `req` that its model does not declare
    (pydantic keeps them in model_extra) and so nothing reads. They are not refused: clients
    written for upstream SGLang send its extra_body fields. Each (route, set of names) warns
    once while it is among the last `remember` sets seen, later at debug level, so a client
    that always sends the same extras does not fill the log; a warning lists at most
    IGNORED_NAMES_SHOWN names, each quoted (repr: a newline cannot forge a log line) and cut
    to IGNORED_NAME_CHARS characters."""
    extra = req.model_extra
    if not extra:
        return
    key = (route, frozenset(extra))
    seen = key in _warned_ignored
    _warned_ignored[key] = None
    _warned_ignored.move_to_end(key)
    while len(_warned_ignored) > remember:
        _warned_ignored.popitem(last=False)
    names = sorted(extra)
    shown = ", ".join(repr(n[:IGNORED_NAME_CHARS]) for n in names[:IGNORED_NAMES_SHOWN])
    more = len(names) - IGNORED_NAMES_SHOWN
    logger.log(
        logging.DEBUG if seen else logging.WARNING,
        "%s: ignored request fields (this server does not read them): %s%s",
        route,
        shown,
        f" and {more} more" if more > 0 else "",
    )


def check_model(tm: Any, model: str) -> None:
    """404 unless `model` is the served model name, the model path, or "default"."""
    known = {tm.served_model_name, tm.server_args.model_path, "default"}
    if model not in known:
        raise OpenAIError(
            f"The model '{model}' does not exist; this server serves '{tm.served_model_name}'.",
            404,
            param="model",
            code="model_not_found",
        )


def check_max_tokens(
    tm: Any, max_tokens: int | None, prompt_len: int | None, param: str, field: str = "max_tokens"
) -> None:
    """400 when the prompt (when known; blamed on `param`) cannot fit, or when max_tokens (named
    `field`; plus the prompt, when known) exceeds the context length: the engine's rules and
    wording (request_validation), checked before the engine when the prompt is tokenised here."""
    ctx = tm.model_config.context_len
    try:
        if prompt_len is not None:
            check_prompt_fits(prompt_len, ctx, getattr(tm, "max_total_num_tokens", None))
        check_max_new_tokens(max_tokens, prompt_len, ctx, field)
    except ContextLengthError as e:
        blame = param if e.param == "prompt" else e.param
        raise OpenAIError(str(e), 400, param=blame, code=e.code) from None


def finish_reason(meta: dict) -> tuple[str | None, Any]:
    """(OpenAI finish_reason, matched stop) from meta_info["finish_reason"]."""
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    return fr.get("type"), fr.get("matched")


def usage(metas: list[dict], n: int) -> dict:
    """OpenAI usage; prompt tokens counted once per prompt (outputs are prompt-major)."""
    prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def as_list(out: Any) -> list[dict]:
    return out if isinstance(out, list) else [out]


def engine_request(req: SamplingFields, max_new_tokens: int | None, **kw: Any) -> GenerateReqInput:
    return GenerateReqInput(
        sampling_params=req.to_sampling_params(max_new_tokens),
        stream=req.stream,
        rid=req.rid,
        **kw,
    )
