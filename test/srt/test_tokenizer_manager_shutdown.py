"""TokenizerManager.finish_all_local, which the HTTP server calls as it begins to stop: a stream
that has sent something ends with finish_reason abort; a request with nothing sent yet (every
non-streamed one: the scheduler sends its output at its end) and every request that arrives
later fail with ServerClosingError (HTTP 503); an output the scheduler sends after that is
dropped (found: a late token chunk overwrote the abort, so a stream ended with [DONE] but no
reason)."""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import ServerClosingError
from sglang.test.tokenizer_manager_fakes import batch_out, fake_tokenizer_manager

MESSAGE = "the server is shutting down"
REASON = {"type": "abort", "message": MESSAGE}


def test_shutdown_ends_streams_and_refuses_what_it_cannot_finish():
    async def run() -> None:
        tm, _ = fake_tokenizer_manager()
        stream = tm.generate_request(GenerateReqInput("t", rid="s", stream=True))
        first = asyncio.ensure_future(stream.__anext__())
        waiter = tm.generate_request(GenerateReqInput("t", rid="w", stream=False))
        whole = asyncio.ensure_future(waiter.__anext__())
        fresh = tm.generate_request(GenerateReqInput("t", rid="f", stream=True))
        unsent = asyncio.ensure_future(fresh.__anext__())  # a stream with nothing sent yet
        await asyncio.sleep(0)
        tm._handle_batch_out(batch_out("s", [7, 8]))
        assert (await first)["output_ids"] == [7, 8]
        tm._handle_batch_out(batch_out("w", [5]))  # not sent to a non-streamed client
        gone = tm.generate_request(GenerateReqInput("t", rid="g", stream=True))
        nxt = asyncio.ensure_future(gone.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(batch_out("g", [1]))
        await nxt
        await gone.aclose()  # its client left: abandoned, waiting for the scheduler's abort
        assert tm.rid_to_state["g"].abandoned

        assert tm.finish_all_local(MESSAGE) == 3
        assert "g" not in tm.rid_to_state  # nobody reads it
        tm._handle_batch_out(batch_out("s", [9]))  # the scheduler did not stop at once
        last = await stream.__anext__()
        assert last["output_ids"] == [7, 8] and last["meta_info"]["finish_reason"] == REASON
        for refused in (whole, unsent):
            with pytest.raises(ServerClosingError, match=MESSAGE):
                await refused
        late = tm.generate_request(GenerateReqInput("t", rid="late", stream=False))
        with pytest.raises(ServerClosingError, match=MESSAGE):
            await late.__anext__()
        assert "late" not in tm.rid_to_state  # refused before it was submitted
        assert tm.finish_all_local(MESSAGE) == 0  # already ended
        await stream.aclose()
        assert tm.rid_to_state == {}  # every rid free again

    asyncio.run(run())


def test_a_refused_choice_ends_a_multi_request_stream_instead_of_hanging():
    """_wait_many_stream's pumps pass a choice's error to the consumer (before, a pump that
    raised never signalled its end and the stream waited forever)."""

    async def run() -> None:
        tm, _ = fake_tokenizer_manager()
        gen = tm.generate_request(GenerateReqInput(["a", "b"], rid=["m0", "m1"], stream=True))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(batch_out("m0", [3]))
        assert (await first)["output_ids"] == [3]
        tm.finish_all_local(MESSAGE)  # m1 has sent nothing: its pump gets the 503
        with pytest.raises(ServerClosingError, match=MESSAGE):
            while True:
                await asyncio.wait_for(gen.__anext__(), timeout=5)

    asyncio.run(run())
