"""POST /v1/completions (OpenAI's legacy completions API) over the shared engine driver of
serving_base.py: prompts as text or token ids, n, echo, logprobs, streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.errors import OpenAIError, OrjsonResponse
from sglang.srt.entrypoints.openai.protocol import CompletionRequest
from sglang.srt.entrypoints.openai.serving_base import (
    EngineStream,
    as_list,
    check_max_tokens,
    check_model,
    engine_request,
    finish_reason,
    generate_once,
    open_stream,
    sse_frames,
    usage,
)
from sglang.srt.managers.request_expansion import response_rid


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

    def _logprobs(
        self, req: CompletionRequest, meta: dict, echo: str | None, skip: int, offset: int = 0
    ) -> Any:
        """Logprobs of output entries from `skip` on (with the prompt's first when echoing);
        text_offset counts from `offset`, the choice's characters before the first entry."""
        if req.logprobs is None:
            return None
        tok = self.tm.tokenizer
        entries = list(meta.get("output_token_logprobs") or [])[skip:]
        tops = list(meta.get("output_top_logprobs") or [])[skip:] if req.logprobs else None
        if echo is not None and skip == 0:
            entries = list(meta.get("input_token_logprobs") or []) + entries
            if tops is not None:
                tops = list(meta.get("input_top_logprobs") or []) + tops
        return _completion_logprobs(tok, entries, tops, offset)

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
            "id": "cmpl-" + response_rid(outs[0]["meta_info"].get("id", ""), req.n),
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
        lp_offset: dict[int, int] = {}  # text_offset of each choice's next logprob entry
        metas: dict[int, dict] = {}
        created = int(time.time())
        cid = "cmpl-" + response_rid(next(iter(stream.rids), ""), req.n)
        async for out in stream:
            meta = out["meta_info"]
            idx = meta.get("index", 0)
            metas[idx] = meta
            text = out["text"]
            start = sent_text.get(idx, 0)
            delta = text[start:] if len(text) >= start else ""
            prefix = echo[idx // req.n] if (echo is not None and idx not in sent_text) else None
            sent_text[idx] = max(start, len(text))
            reason, matched = finish_reason(meta)
            if not delta and reason is None and prefix is None:
                # Nothing to show yet (text held back: an incomplete UTF-8 character or a
                # possible stop string); its tokens' logprobs go with the next chunk.
                continue
            lp = self._logprobs(req, meta, prefix, sent_lp.get(idx, 0), lp_offset.get(idx, 0))
            sent_lp[idx] = len(meta.get("output_token_logprobs") or [])
            if lp and lp["tokens"]:  # offsets continue across chunks, as in one response
                lp_offset[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
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
