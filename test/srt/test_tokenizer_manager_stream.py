"""TokenizerManager._wait_one: a streamed request that finishes while its consumer is between
two outputs still delivers its final output (found as a chat stream that ended without its
last token and finish_reason, 3 in 400 requests of max_tokens 2 under concurrency)."""

from __future__ import annotations

import asyncio

from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager


def _manager_with(state: ReqState) -> TokenizerManager:
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state = {state.rid: state}
    return tm


def test_finish_during_suspended_yield_is_delivered():
    async def run() -> list[dict]:
        state = ReqState(rid="r", prompt_tokens=3, return_logprob=False)
        gen = _manager_with(state)._wait_one("r", stream=True)
        state.output_ids.append(11)
        state.event.set()
        outs = [await gen.__anext__()]  # first token; the generator is now suspended
        state.output_ids.append(12)  # the final output arrives before the consumer asks again
        state.finished = True
        state.meta["finish_reason"] = {"type": "length"}
        state.event.set()
        async for out in gen:
            outs.append(out)
        return outs

    outs = asyncio.run(run())
    assert [o["output_ids"] for o in outs] == [[11], [11, 12]]
    assert outs[0]["meta_info"]["finish_reason"] is None
    assert outs[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert outs[-1]["meta_info"]["completion_tokens"] == 2


def test_non_streaming_waits_for_the_final_output():
    async def run() -> list[dict]:
        state = ReqState(rid="r", prompt_tokens=3, return_logprob=False)
        gen = _manager_with(state)._wait_one("r", stream=False)

        async def feed() -> None:
            for tok in (5, 6):
                await asyncio.sleep(0)
                state.output_ids.append(tok)
                state.event.set()
            state.finished = True
            state.event.set()

        feeder = asyncio.create_task(feed())
        outs = [out async for out in gen]
        await feeder
        return outs

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0]["output_ids"] == [5, 6]
