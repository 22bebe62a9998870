"""TokenizerManager._handle_loop: a control reply that arrives after its waiter gave up must not
kill the output loop.

Found over HTTP (plain CPU server, --chunked-prefill-size -1): /get_server_info (or a /metrics
scrape) during a prefill step longer than INTERNAL_STATE_TIMEOUT_S (5 s) times out; asyncio's
wait_for cancels the _ask future, which stays in _pending_replies; the scheduler's late reply
is given to it, set_result raises InvalidStateError, the _handle_loop task ends, and every
in-flight request stalls (a streamed request got 0 chunks in 40 s) until a new request
restarts the loop.
"""

from __future__ import annotations

import asyncio

from sglang.srt.managers.io_struct import BatchStrOut, GetInternalStateReqOutput
from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager


class _FakeSocket:
    def __init__(self, msgs: list) -> None:
        self.msgs = list(msgs)

    async def recv_pyobj(self):
        if self.msgs:
            return self.msgs.pop(0)
        await asyncio.sleep(3600)


def test_late_reply_to_a_cancelled_waiter_keeps_the_loop_alive():
    async def run() -> tuple[ReqState, asyncio.Task]:
        tm = object.__new__(TokenizerManager)
        tm.metrics_collector = None
        state = ReqState(rid="r", prompt_tokens=1, return_logprob=False)
        tm.rid_to_state = {"r": state}
        gave_up = asyncio.get_running_loop().create_future()
        gave_up.cancel()  # what wait_for leaves behind when /get_server_info times out
        tm._pending_replies = {GetInternalStateReqOutput: [gave_up]}
        done = BatchStrOut(
            rids=["r"],
            text=["a"],
            output_ids_delta=[[5]],
            finished_reason=[{"type": "length", "matched": None}],
            meta=[{"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}],
            output_token_logprobs_delta=[None],
            output_top_logprobs_delta=[None],
            input_token_logprobs=[None],
            input_top_logprobs=[None],
            first_token_time=[None],
            text_offset=[0],
        )
        tm.recv_from_scheduler = _FakeSocket([GetInternalStateReqOutput(state={}), done])
        task = asyncio.create_task(tm._handle_loop())
        for _ in range(20):
            await asyncio.sleep(0)
        alive = not task.done()
        task.cancel()
        return state, alive

    state, alive = asyncio.run(run())
    assert alive  # ended with InvalidStateError from set_result on the cancelled future
    assert state.finished  # the request's final output after the late reply was handled
