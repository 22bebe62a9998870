"""POST /v1/chat/completions: render messages with the chat template, generate, answer in the
OpenAI chat format (non-streaming, or SSE chunks with optional usage)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.errors import (
    OpenAIError,
    OrjsonResponse,
    from_engine_exception,
)
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
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
from sglang.srt.managers.request_validation import ContextLengthError

logger = logging.getLogger(__name__)

# Used only when neither --chat-template nor the tokenizer provides a template (e.g. tiny test
# models); ChatML is what SmolLM2 and many small models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_chat_template(arg: str | None) -> str | None:
    """--chat-template: a file path (read it) or an inline Jinja template; None -> None.

    Raises ValueError when the argument is neither an existing file nor Jinja text.
    """
    if arg is None:
        return None
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            text = f.read()
        if arg.endswith(".json"):
            text = json.loads(text).get("chat_template", text)
        return text
    if "{{" in arg or "{%" in arg:
        return arg
    raise ValueError(f"--chat-template {arg!r} is neither a file nor an inline Jinja template")


def _chat_logprobs(tok: Any, entries: list, tops: list | None) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def item(lp: float, tid: int) -> dict:
        s = tok.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for i, (lp, tid, *_) in enumerate(entries):
        row = (tops[i] if tops is not None and i < len(tops) else None) or []
        content.append({**item(lp, tid), "top_logprobs": [item(t[0], t[1]) for t in row]})
    return {"content": content}


class OpenAIServingChat:
    """Handler of POST /v1/chat/completions over a TokenizerManager."""

    def __init__(self, tokenizer_manager: Any, chat_template: str | None = None) -> None:
        self.tm = tokenizer_manager
        self.chat_template = chat_template
        self._warned_fallback = False

    def _template(self) -> str | None:
        if self.chat_template is not None:
            return self.chat_template
        if getattr(self.tm.tokenizer, "chat_template", None):
            return None  # the tokenizer's own
        if not self._warned_fallback:
            logger.warning("tokenizer has no chat template; falling back to ChatML")
            self._warned_fallback = True
        return CHATML_TEMPLATE

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """Token ids of the rendered conversation (generation prompt appended)."""
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        cont = req.continue_final_message and req.messages[-1].role == "assistant"
        try:
            text = self.tm.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not cont,
                continue_final_message=cont,
                chat_template=self._template(),
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - jinja errors are the client's messages
            raise OpenAIError(
                f"could not apply the chat template to messages: {e}", 400, param="messages"
            ) from e
        try:
            self.tm.check_text_size(text, "messages")
        except ContextLengthError as e:
            raise from_engine_exception(e) from None
        return self.tm.tokenizer.encode(text, add_special_tokens=False)

    async def handle(self, req: ChatCompletionRequest, raw: Request) -> Any:
        check_model(self.tm, req.model)
        chars = sum(len(m.text()) for m in req.messages)
        ids = await self.tm.off_loop(lambda: self.prompt_ids(req), chars)
        max_new = req.max_new_tokens()
        field = req.max_tokens_field()
        check_max_tokens(self.tm, max_new, len(ids), "messages", field)
        obj = engine_request(
            req,
            max_new,
            input_ids=ids,
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
        )
        rf = req.response_format or {}
        if rf.get("type") not in (None, "text", "json_schema"):
            raise OpenAIError(
                f"response_format type {rf.get('type')!r} is not supported yet",
                param="response_format",
            )
        if req.tools:
            raise OpenAIError("tools (function calling) are not supported yet", param="tools")
        if rf.get("type") == "json_schema" and obj.sampling_params.get("json_schema") is None:
            schema = (rf.get("json_schema") or {}).get("schema", {})
            obj.sampling_params["json_schema"] = json.dumps(schema)
        if req.stream:
            stream = await open_stream(self.tm, obj, raw, field)
            return StreamingResponse(
                sse_frames(self._chunks(req, stream)), media_type="text/event-stream"
            )
        outs = as_list(await generate_once(self.tm, obj, raw, field))
        return OrjsonResponse(self._response(req, outs))

    def _logprobs(self, req: ChatCompletionRequest, meta: dict, skip: int) -> dict | None:
        if not req.logprobs:
            return None
        entries = list(meta.get("output_token_logprobs") or [])[skip:]
        tops = list(meta.get("output_top_logprobs") or [])[skip:] if req.top_logprobs else None
        return _chat_logprobs(self.tm.tokenizer, entries, tops)

    def _response(self, req: ChatCompletionRequest, outs: list[dict]) -> dict:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            reason, matched = finish_reason(meta)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out["text"], "tool_calls": None},
                    "logprobs": self._logprobs(req, meta, 0),
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        return {
            "id": "chatcmpl-" + response_rid(outs[0]["meta_info"].get("id", ""), req.n),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": usage([o["meta_info"] for o in outs], req.n),
        }

    async def _chunks(self, req: ChatCompletionRequest, stream: EngineStream) -> AsyncIterator:
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        metas: dict[int, dict] = {}
        created = int(time.time())
        cid = "chatcmpl-" + response_rid(next(iter(stream.rids), ""), req.n)

        def chunk(choices: list[dict], usage_: dict | None = None) -> dict:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": choices,
                "usage": usage_,
            }

        async for out in stream:
            meta = out["meta_info"]
            idx = meta.get("index", 0)
            metas[idx] = meta
            if idx not in sent_text:
                sent_text[idx] = 0
                yield chunk(
                    [
                        {
                            "index": idx,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            text, start = out["text"], sent_text[idx]
            delta = text[start:] if len(text) >= start else ""
            sent_text[idx] = max(start, len(text))
            reason, matched = finish_reason(meta)
            if not delta and reason is None:
                # Nothing to show yet (text held back: an incomplete UTF-8 character or a
                # possible stop string); its tokens' logprobs go with the next chunk.
                continue
            lp = self._logprobs(req, meta, sent_lp.get(idx, 0))
            sent_lp[idx] = len(meta.get("output_token_logprobs") or [])
            yield chunk(
                [
                    {
                        "index": idx,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": lp,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ]
            )
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage([metas[i] for i in sorted(metas)], req.n))
