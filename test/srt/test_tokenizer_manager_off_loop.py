"""TokenizerManager: long prompt texts are tokenized on a worker thread, so the HTTP event loop
keeps serving meanwhile.

Found over HTTP (CPU, helper-62, twenty-second session): a /generate body of 2M emoji, under
check_text_size's character bound, was tokenized on the event loop for ~10 s (it then got its
correct 400, context_length_exceeded), and /health waited all that time. The fast tokenizer
releases the GIL while it encodes, so off the loop other requests proceed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import OFF_LOOP_TOKENIZE_CHARS, TokenizerManager


class Tokenized(Exception):
    """Raised by the stand-in tokenization once it has run (ends the request early)."""


def _manager(seen: list, work_s: float) -> TokenizerManager:
    """A TokenizerManager whose _tokenize records its thread, sleeps work_s (releasing the GIL,
    as the fast tokenizer does) and raises Tokenized."""
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state = {}
    tm.rid_groups = {}
    tm.served_model_name = "m"
    tm.server_args = SimpleNamespace(model_path="m")
    tm._ensure_handle_loop = lambda: None
    tm._expand = lambda obj: [obj]

    def tokenize(o):
        seen.append(threading.get_ident())
        time.sleep(work_s)
        raise Tokenized

    tm._tokenize = tokenize
    return tm


async def _ticks_while(coro) -> tuple[int, BaseException | None]:
    """How many 5 ms ticks the event loop ran while coro was pending, and what it raised."""
    ticks, done = 0, False

    async def tick() -> None:
        nonlocal ticks
        while not done:
            await asyncio.sleep(0.005)
            ticks += 1

    t = asyncio.create_task(tick())
    err = None
    try:
        await coro
    except BaseException as e:  # noqa: BLE001 - returned to the test
        err = e
    done = True
    await t
    return ticks, err


async def _generate(tm: TokenizerManager, text: str) -> None:
    async for _ in tm.generate_request(GenerateReqInput(text=text, rid="r")):
        pass


@pytest.mark.parametrize("chars", [100, OFF_LOOP_TOKENIZE_CHARS + 1])
def test_generate_tokenizes_long_texts_off_the_event_loop(chars):
    seen: list = []
    tm = _manager(seen, work_s=0.3)

    async def run() -> tuple[int, BaseException | None, int]:
        ticks, err = await _ticks_while(_generate(tm, "😀" * chars))
        return ticks, err, threading.get_ident()

    ticks, err, loop_thread = asyncio.run(run())
    assert isinstance(err, Tokenized) and len(seen) == 1
    if chars > OFF_LOOP_TOKENIZE_CHARS:
        assert seen[0] != loop_thread
        assert ticks >= 5  # the loop kept running through the 0.3 s of tokenization
    else:
        assert seen[0] == loop_thread  # short texts: no thread hop
        assert ticks <= 1


def test_errors_of_off_loop_tokenization_reach_the_caller():
    tm = _manager([], work_s=0.0)

    def bad():
        raise ValueError("the prompt is empty")

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(tm.off_loop(bad, OFF_LOOP_TOKENIZE_CHARS + 1))
    assert asyncio.run(tm.off_loop(lambda: [1, 2], OFF_LOOP_TOKENIZE_CHARS + 1)) == [1, 2]


@pytest.mark.parametrize("chars", [100, OFF_LOOP_TOKENIZE_CHARS + 1])
def test_chat_renders_and_tokenizes_long_conversations_off_the_event_loop(chars):
    seen: list = []
    tm = _manager(seen, work_s=0.0)
    chat = OpenAIServingChat(tm)

    def prompt_ids(req):
        seen.append(threading.get_ident())
        time.sleep(0.3)
        raise Tokenized

    chat.prompt_ids = prompt_ids
    half = chars // 2 + 1  # two messages together over the threshold
    req = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": "x" * half},
            {"role": "user", "content": "y" * half},
        ],
    )

    async def run() -> tuple[int, BaseException | None, int]:
        ticks, err = await _ticks_while(chat.handle(req, None))
        return ticks, err, threading.get_ident()

    ticks, err, loop_thread = asyncio.run(run())
    assert isinstance(err, Tokenized)
    assert (seen[0] != loop_thread) == (2 * half > OFF_LOOP_TOKENIZE_CHARS)
    if 2 * half > OFF_LOOP_TOKENIZE_CHARS:
        assert ticks >= 5
