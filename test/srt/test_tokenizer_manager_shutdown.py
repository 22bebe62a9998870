"""TokenizerManager.finish_all_local: at shutdown every request in flight ends on the HTTP
side with finish_reason abort, and an output the scheduler sends after that is dropped (found:
a late token chunk overwrote the abort, so a stream ended with [DONE] but no reason)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sglang.srt.managers.io_struct import BatchStrOut, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager

REASON = {"type": "abort", "message": "the server is shutting down"}


def _manager() -> TokenizerManager:
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state, tm.rid_groups, tm.metrics_collector = {}, {}, None
    tm.server_args = SimpleNamespace(
        log_requests=False, max_queued_requests=None, max_running_requests=8
    )
    tm._send = lambda obj: None
    tm._ensure_handle_loop = lambda: None
    tm._tokenize = lambda o: SimpleNamespace(rid=o.rid, input_ids=[1, 2, 3], return_logprob=False)
    tm._expand = lambda obj: [obj]
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


def test_streams_and_waiters_end_with_abort_and_late_outputs_are_dropped():
    async def run() -> None:
        tm = _manager()
        stream = tm.generate_request(GenerateReqInput("t", rid="s", stream=True))
        first = asyncio.ensure_future(stream.__anext__())
        waiter = tm.generate_request(GenerateReqInput("t", rid="w", stream=False))
        whole = asyncio.ensure_future(waiter.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("s", [7, 8]))
        assert (await first)["output_ids"] == [7, 8]
        tm._handle_batch_out(_out("w", [5]))  # a non-streamed request's output so far
        gone = tm.generate_request(GenerateReqInput("t", rid="g", stream=True))
        nxt = asyncio.ensure_future(gone.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("g", [1]))
        await nxt
        await gone.aclose()  # its client left: abandoned, waiting for the scheduler's abort
        assert tm.rid_to_state["g"].abandoned

        assert tm.finish_all_local(REASON["message"]) == 2
        assert "g" not in tm.rid_to_state  # nobody reads it
        tm._handle_batch_out(_out("s", [9]))  # the scheduler did not stop at once
        last = await stream.__anext__()
        assert last["output_ids"] == [7, 8] and last["meta_info"]["finish_reason"] == REASON
        assert (await whole)["meta_info"]["finish_reason"] == REASON
        assert tm.finish_all_local(REASON["message"]) == 0  # already ended
        await stream.aclose()
        await waiter.aclose()
        assert tm.rid_to_state == {}  # both rids free again

    asyncio.run(run())
