"""TokenizerManager._handle_batch_out on a speculative server: an output whose counters carry no
accept histogram (the scheduler sent it in an earlier message) for a request state that never
saw one must not raise out of the output loop.

Found over HTTP (--speculative-adaptive, CPU): a streamed request with a client-chosen rid is
disconnected, its state is popped and an AbortReq sent; the client resends the same rid at
once; the old request's next message (histogram None: nothing drafted since the last one) is
applied to the new state, merge_spec raises ValueError, the _handle_loop task dies, and every
in-flight request (the resent one included) hangs until some new request restarts the loop;
the rest of that message (other requests' outputs, possibly their final ones) is lost.
Before cbbfba4 the same sequence gave the resent request the old one's abort, but nothing hung.
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BatchStrOut
from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager


def test_stray_counters_without_histogram_do_not_break_the_output_loop():
    tm = object.__new__(TokenizerManager)
    tm.metrics_collector = None
    reused = ReqState(rid="reused", prompt_tokens=4, return_logprob=False)  # no message yet
    other = ReqState(rid="other", prompt_tokens=3, return_logprob=False)
    other.spec = (2, 1, 6, (1, 1, 0, 0))  # histogram received earlier
    tm.rid_to_state = {"reused": reused, "other": other}
    msg = BatchStrOut(
        rids=["reused", "other"],
        text=[" x", " y"],
        output_ids_delta=[[7], [8]],
        finished_reason=[None, {"type": "length", "matched": None}],
        meta=[
            {"prompt_tokens": 4, "completion_tokens": 6, "cached_tokens": 0},
            {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0},
        ],
        output_token_logprobs_delta=[None, None],
        output_top_logprobs_delta=[None, None],
        input_token_logprobs=[None, None],
        input_top_logprobs=[None, None],
        first_token_time=[None, None],
        text_offset=[0, 0],
        spec=[(5, 2, 10, None), (3, 1, 9, None)],
    )
    tm._handle_batch_out(msg)  # raised ValueError from merge_spec
    # the other request's output in the same message, here its final one, is not lost
    assert other.finished and other.event.is_set()
    meta = tm._output(other)["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert meta["spec_verify_ct"] == 3 and meta["spec_accept_histogram"] == [1, 1, 0, 0]
