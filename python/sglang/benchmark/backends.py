"""Streaming request functions of bench_serving, one per --backend.

Each sends one streaming request and measures, with time.perf_counter: TTFT (send -> first
chunk carrying output), ITL (gaps between later chunks that carry output) and end-to-end
latency. `sglang` uses the native /generate (whose chunks carry meta_info, hence completion
token counts and spec_accept_length); `sglang-oai` /v1/completions; `sglang-oai-chat`
/v1/chat/completions (both with stream_options.include_usage for exact token counts).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestFuncInput:
    prompt: str
    prompt_len: int  # tokens
    output_len: int  # max new tokens
    base_url: str
    model: str
    ignore_eos: bool = True
    extra_request_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_len: int = 0  # completion tokens reported by the server
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds
    spec_accept_length: float | None = None
    error: str = ""


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """JSON payloads of `data: ...` lines until `data: [DONE]`; error frames raise."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        event = json.loads(payload)
        if isinstance(event, dict) and "error" in event:
            raise RuntimeError(f"server error: {event['error']}")
        yield event


async def _run(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    inp: RequestFuncInput,
    step: Callable[[dict, RequestFuncOutput], tuple[bool, int | None]],
) -> RequestFuncOutput:
    """POST `body`; `step(event, out)` updates text and returns (chunk has output, tokens)."""
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=inp.headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {await resp.text()}"
                return out
            async for event in _sse_events(resp):
                has_output, tokens = step(event, out)
                if tokens is not None:
                    out.output_len = tokens
                if not has_output:
                    continue
                now = time.perf_counter()
                if out.ttft == 0.0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
        out.latency = time.perf_counter() - start
        out.success = True
    except Exception:  # noqa: BLE001 - a failed request is a result, not a crash
        out.error = traceback.format_exc(limit=2)
    return out


async def request_sglang_generate(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    extra = dict(inp.extra_request_body)
    sampling = {
        "temperature": 0.0,
        "max_new_tokens": inp.output_len,
        "ignore_eos": inp.ignore_eos,
        **(extra.pop("sampling_params", None) or {}),  # merged, not replacing the lengths
    }
    body = {"text": inp.prompt, "sampling_params": sampling, "stream": True, **extra}
    seen = {"tokens": 0}

    def step(event: dict, out: RequestFuncOutput) -> tuple[bool, int | None]:
        meta = event.get("meta_info", {})
        tokens = meta.get("completion_tokens", len(event.get("output_ids", [])))
        out.generated_text = event.get("text", out.generated_text)
        if meta.get("spec_accept_length") is not None:
            out.spec_accept_length = float(meta["spec_accept_length"])
        grew = tokens > seen["tokens"]
        seen["tokens"] = tokens
        return grew, tokens

    return await _run(session, inp.base_url + "/generate", body, inp, step)


def _oai_body(inp: RequestFuncInput) -> dict:
    return {
        "model": inp.model,
        "temperature": 0.0,
        "max_tokens": inp.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": inp.ignore_eos,
        **inp.extra_request_body,
    }


def _usage_tokens(event: dict) -> int | None:
    usage = event.get("usage")
    return usage.get("completion_tokens") if usage else None


async def request_openai_completions(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    body = {**_oai_body(inp), "prompt": inp.prompt}

    def step(event: dict, out: RequestFuncOutput) -> tuple[bool, int | None]:
        text = "".join(c.get("text") or "" for c in event.get("choices", []))
        out.generated_text += text
        return bool(text), _usage_tokens(event)

    return await _run(session, inp.base_url + "/v1/completions", body, inp, step)


async def request_openai_chat(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    body = {**_oai_body(inp), "messages": [{"role": "user", "content": inp.prompt}]}

    def step(event: dict, out: RequestFuncOutput) -> tuple[bool, int | None]:
        text = "".join((c.get("delta") or {}).get("content") or "" for c in event["choices"])
        out.generated_text += text
        return bool(text), _usage_tokens(event)

    return await _run(session, inp.base_url + "/v1/chat/completions", body, inp, step)


RequestFunc = Callable[[aiohttp.ClientSession, RequestFuncInput], Awaitable[RequestFuncOutput]]
BACKENDS: dict[str, RequestFunc] = {
    "sglang": request_sglang_generate,
    "sglang-oai": request_openai_completions,
    "sglang-oai-chat": request_openai_chat,
}


def backend_func(name: str) -> Any:
    """The request function of --backend `name`. Raises ValueError for unknown names."""
    if name not in BACKENDS:
        raise ValueError(f"unknown --backend {name!r}; expected one of {sorted(BACKENDS)}")
    return BACKENDS[name]
