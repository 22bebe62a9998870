"""Streamed OpenAI logprobs: a step whose text is held back (an incomplete UTF-8 character, a
possible stop string) sends no chunk; its tokens' logprobs must go with the next chunk, not be
dropped (a stream of 24 tokens carried 18 entries), and completions' text_offset continues
across chunks as in the non-streamed response (each chunk restarted at 0)."""

from __future__ import annotations

import asyncio

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.entrypoints.openai.serving_base import EngineStream
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

PIECES = {1: "a", 2: "\u00e9", 3: "", 4: "bc"}  # token 3 alone decodes to nothing (held back)


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(PIECES[i] for i in ids)


class _TM:
    tokenizer = _Tok()


def _outs() -> list[dict]:
    """Cumulative outputs of one request over 4 steps; step 3's text is held back."""
    steps = [([1], "a"), ([1, 2], "a\u00e9"), ([1, 2, 3], "a\u00e9"), ([1, 2, 3, 4], "a\u00e9bc")]
    outs = []
    for k, (ids, text) in enumerate(steps):
        last = k == len(steps) - 1
        meta = {
            "id": "r",
            "prompt_tokens": 2,
            "completion_tokens": len(ids),
            "finish_reason": {"type": "length", "matched": None} if last else None,
            "output_token_logprobs": [(-0.1 * t, t, None) for t in ids],
            "output_top_logprobs": [[(-0.1 * t, t, None)] for t in ids],
        }
        outs.append({"text": text, "output_ids": list(ids), "meta_info": meta})
    return outs


async def _agen(outs: list[dict]):
    for o in outs:
        yield o


def _collect(handler, req) -> list[dict]:
    async def run() -> list[dict]:
        stream = EngineStream(_TM(), _agen(_outs()), None, {"r"})
        return [c async for c in handler._chunks(req, stream, *extra)]

    extra = (None,) if isinstance(handler, OpenAIServingCompletion) else ()
    return asyncio.run(run())


def test_completion_stream_keeps_every_logprob_and_offset():
    req = CompletionRequest(model="default", prompt="x", logprobs=1, stream=True)
    chunks = _collect(OpenAIServingCompletion(_TM()), req)
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    tokens = [t for lp in lps for t in lp["tokens"]]
    offsets = [o for lp in lps for o in lp["text_offset"]]
    assert tokens == ["a", "\u00e9", "", "bc"]
    assert offsets == [0, 1, 2, 2]  # as the non-streamed response counts them
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "a\u00e9bc"


def test_chat_stream_keeps_every_logprob():
    req = ChatCompletionRequest(
        model="default",
        messages=[{"role": "user", "content": "x"}],
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    chunks = _collect(OpenAIServingChat(_TM()), req)
    entries = [
        e["token"]
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert entries == ["a", "\u00e9", "", "bc"]
