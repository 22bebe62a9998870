"""POST /v1/completions, plus the engine driver every endpoint shares.

The driver (`generate_once`, `open_stream`) runs TokenizerManager.generate_request for one HTTP
request: it gives the request ids, maps engine exceptions to OpenAI errors (ValueError -> 400,
QueueFullError -> 503), and aborts the request (freeing its KV) when the client disconnects.
For streams it pulls the first output before the response starts, so invalid requests still
get a proper 4xx status instead of an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.errors import (
    OpenAIError,
    OrjsonResponse,
    error_body,
    from_engine_exception,
)
from sglang.srt.entrypoints.openai.protocol import CompletionRequest, SamplingFields
from sglang.srt.managers.io_struct import GenerateReqInput, new_rid
from sglang.srt.managers.request_validation import (
    ContextLengthError,
    check_max_new_tokens,
    check_prompt_fits,
)

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
        yield sse(error_body(str(e), 500))
    yield SSE_DONE


# ---- shared OpenAI helpers -------------------------------------------------------------------
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


# ---- /v1/completions -------------------------------------------------------------------------
def _completion_logprobs(tok: Any, entries: list, tops: list | None, offset: int) -> dict:
    """OpenAI completions logprobs {tokens, token_logprobs, top_logprobs, text_offset}."""
    tokens, lps, top, offsets = [], [], [], []
    for i, (lp, tid, *_) in enumerate(entries):
        s = tok.decode([tid])
        tokens.append(s)
        lps.append(lp)
        offsets.append(offset)
        offset += len(s)
        if tops is not None:
            row = tops[i] if i < len(tops) else None
            top.append({tok.decode([t[1]]): t[0] for t in row} if row else None)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": top if tops else None,
        "text_offset": offsets,
    }


class OpenAIServingCompletion:
    """Handler of POST /v1/completions over a TokenizerManager."""

    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    async def handle(self, req: CompletionRequest, raw: Request) -> Any:
        check_model(self.tm, req.model)
        if req.best_of not in (None, 1) and req.best_of != req.n:
            raise OpenAIError("best_of other than n is not supported yet", param="best_of")
        if req.suffix:
            raise OpenAIError("suffix (insertion) is not supported", param="suffix")
        prompts = req.prompt
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        check_max_tokens(self.tm, req.max_tokens, None, "prompt")
        kw: dict[str, Any] = {}
        if isinstance(prompt_list[0], str):
            kw["text"] = prompt_list[0] if single else prompt_list
        else:
            kw["input_ids"] = prompt_list[0] if single else prompt_list
        want_lp = req.logprobs is not None
        obj = engine_request(
            req,
            req.max_tokens,
            return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (req.echo and want_lp) else -1,
            **kw,
        )
        echo_texts = [self._prompt_text(p) for p in prompt_list] if req.echo else None
        if req.stream:
            stream = await open_stream(self.tm, obj, raw, "max_tokens")
            return StreamingResponse(
                sse_frames(self._chunks(req, stream, echo_texts)), media_type="text/event-stream"
            )
        outs = as_list(await generate_once(self.tm, obj, raw, "max_tokens"))
        return OrjsonResponse(self._response(req, outs, echo_texts))

    def _prompt_text(self, p: str | list[int]) -> str:
        return p if isinstance(p, str) else self.tm.tokenizer.decode(p)

    def _logprobs(self, req: CompletionRequest, meta: dict, echo: str | None, skip: int) -> Any:
        if req.logprobs is None:
            return None
        tok = self.tm.tokenizer
        entries = list(meta.get("output_token_logprobs") or [])[skip:]
        tops = list(meta.get("output_top_logprobs") or [])[skip:] if req.logprobs else None
        if echo is not None and skip == 0:
            entries = list(meta.get("input_token_logprobs") or []) + entries
            if tops is not None:
                tops = list(meta.get("input_top_logprobs") or []) + tops
        return _completion_logprobs(tok, entries, tops, 0)

    def _response(self, req: CompletionRequest, outs: list[dict], echo: list[str] | None) -> dict:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            prefix = echo[i // req.n] if echo is not None else None
            reason, matched = finish_reason(meta)
            choices.append(
                {
                    "index": i,
                    "text": (prefix or "") + out["text"],
                    "logprobs": self._logprobs(req, meta, prefix, 0),
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        return {
            "id": "cmpl-" + outs[0]["meta_info"].get("id", ""),
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": usage([o["meta_info"] for o in outs], req.n),
        }

    async def _chunks(
        self, req: CompletionRequest, stream: EngineStream, echo: list[str] | None
    ) -> AsyncIterator[dict]:
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        metas: dict[int, dict] = {}
        created, cid = int(time.time()), "cmpl-" + next(iter(stream.rids), "")
        async for out in stream:
            meta = out["meta_info"]
            idx = meta.get("index", 0)
            metas[idx] = meta
            text = out["text"]
            start = sent_text.get(idx, 0)
            delta = text[start:] if len(text) >= start else ""
            prefix = echo[idx // req.n] if (echo is not None and idx not in sent_text) else None
            sent_text[idx] = max(start, len(text))
            lp = self._logprobs(req, meta, prefix, sent_lp.get(idx, 0))
            sent_lp[idx] = len(meta.get("output_token_logprobs") or [])
            reason, matched = finish_reason(meta)
            if not delta and reason is None and prefix is None:
                continue
            yield {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": idx,
                        "text": (prefix or "") + delta,
                        "logprobs": lp,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": None,
            }
        if req.stream_options and req.stream_options.include_usage:
            yield {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [],
                "usage": usage([metas[i] for i in sorted(metas)], req.n),
            }
