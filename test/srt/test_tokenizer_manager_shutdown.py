"""TokenizerManager.finish_all_local, which the HTTP server calls as it begins to stop: a stream
that has sent something ends with finish_reason abort; a request with nothing sent yet (every
non-streamed one: the scheduler sends its output at its end) and every request that arrives
later fail with ServerClosingError (HTTP 503); an output the scheduler sends after that is
dropped (found: a late token chunk overwrote the abort, so a stream ended with [DONE] but no
reason)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang.srt.managers.io_struct import BatchStrOut, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import ServerClosingError, TokenizerManager

MESSAGE = "the server is shutting down"
REASON = {"type": "abort", "message": MESSAGE}


def _manager() -> TokenizerManager:
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state, tm.rid_groups, tm.metrics_collector = {}, {}, None
    tm.server_args = SimpleNamespace(
        log_requests=False, max_queued_requests=None, max_running_requests=8
    )
    tm._send = lambda obj: None
    tm._ensure_handle_loop = lambda: None
    tm._tokenize = lambda o: SimpleNamespace(rid=o.rid, input_ids=[1, 2, 3], return_logprob=False)
    tm._expand = lambda obj: (
        [obj]
        if not isinstance(obj.rid, list)
        else [GenerateReqInput(rid=r, stream=obj.stream) for r in obj.rid]
    )
    return tm


def _out(rid: str, ids: list[int]) -> BatchStrOut:
    return BatchStrOut(
        rids=[rid],
        text=["x" * len(ids)],
        output_ids_delta=[ids],
        finished_reason=[None],
        meta=[{"prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0}],
        output_token_logprobs_delta=[None],
        output_top_logprobs_delta=[None],
        input_token_logprobs=[None],
        input_top_logprobs=[None],
        first_token_time=[None],
    )


def test_shutdown_ends_streams_and_refuses_what_it_cannot_finish():
    async def run() -> None:
        tm = _manager()
        stream = tm.generate_request(GenerateReqInput("t", rid="s", stream=True))
        first = asyncio.ensure_future(stream.__anext__())
        waiter = tm.generate_request(GenerateReqInput("t", rid="w", stream=False))
        whole = asyncio.ensure_future(waiter.__anext__())
        fresh = tm.generate_request(GenerateReqInput("t", rid="f", stream=True))
        unsent = asyncio.ensure_future(fresh.__anext__())  # a stream with nothing sent yet
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("s", [7, 8]))
        assert (await first)["output_ids"] == [7, 8]
        tm._handle_batch_out(_out("w", [5]))  # not sent to a non-streamed client
        gone = tm.generate_request(GenerateReqInput("t", rid="g", stream=True))
        nxt = asyncio.ensure_future(gone.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("g", [1]))
        await nxt
        await gone.aclose()  # its client left: abandoned, waiting for the scheduler's abort
        assert tm.rid_to_state["g"].abandoned

        assert tm.finish_all_local(MESSAGE) == 3
        assert "g" not in tm.rid_to_state  # nobody reads it
        tm._handle_batch_out(_out("s", [9]))  # the scheduler did not stop at once
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
        tm = _manager()
        gen = tm.generate_request(GenerateReqInput(["a", "b"], rid=["m0", "m1"], stream=True))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("m0", [3]))
        assert (await first)["output_ids"] == [3]
        tm.finish_all_local(MESSAGE)  # m1 has sent nothing: its pump gets the 503
        with pytest.raises(ServerClosingError, match=MESSAGE):
            while True:
                await asyncio.wait_for(gen.__anext__(), timeout=5)

    asyncio.run(run())
