"""TokenizerManager: a request id stays taken until the scheduler's final output for it arrives.

Found over HTTP (CPU, any server): a client that picks its own rid drops a streamed request and
resends the same rid at once. The old request's state was removed when the client left, so
the new request was admitted and received the old one's remaining outputs and its abort,
while its own generation ran unseen. Now the abandoned state keeps the rid (a reuse gets the
"already in flight" 400) until the abort's final output arrives. A batch naming one rid twice,
or a rid already in flight, is refused before any of its requests is sent (before, the first
was sent and its state was never removed).
"""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.managers.io_struct import AbortReq, BatchStrOut, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.test.tokenizer_manager_fakes import batch_out, fake_tokenizer_manager

ABORT = {"type": "abort", "matched": None}


def _out(rid: str, ids: list[int], final: bool) -> BatchStrOut:
    return batch_out(rid, ids, ABORT if final else None)


def test_a_rid_is_taken_until_its_final_output_arrives():
    async def run() -> None:
        tm, sent = fake_tokenizer_manager()
        gen = tm.generate_request(GenerateReqInput("t", rid="r1", stream=True))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("r1", [7, 8], final=False))
        assert (await first)["output_ids"] == [7, 8]
        await gen.aclose()  # the client disconnects
        assert isinstance(sent[-1], AbortReq) and sent[-1].rid == "r1"
        assert tm.rid_to_state["r1"].abandoned
        again = tm.generate_request(GenerateReqInput("t", rid="r1", stream=True))
        with pytest.raises(ValueError, match="already in flight"):
            await again.__anext__()
        tm._handle_batch_out(_out("r1", [9], final=False))  # the old request's next output
        assert tm.rid_to_state["r1"].output_ids == [7, 8]  # not applied
        tm._handle_batch_out(_out("r1", [], final=True))  # the abort's final output
        assert "r1" not in tm.rid_to_state
        fresh = tm.generate_request(GenerateReqInput("t", rid="r1", stream=True))
        nxt = asyncio.ensure_future(fresh.__anext__())
        await asyncio.sleep(0)
        tm._handle_batch_out(_out("r1", [5], final=False))
        assert (await nxt)["output_ids"] == [5]  # its own outputs only
        await fresh.aclose()

    asyncio.run(run())


def test_a_batch_with_a_taken_or_repeated_rid_sends_nothing():
    async def run() -> None:
        tm, sent = fake_tokenizer_manager()
        for rids, why in ((["a", "b", "a"], "more than once"), (["c", "busy"], "in flight")):
            tm.rid_to_state.pop("busy", None)
            if "busy" in rids:
                tm.rid_to_state["busy"] = object()
            gen = tm.generate_request(GenerateReqInput(["t"] * len(rids), rid=rids))
            with pytest.raises(ValueError, match=why):
                await gen.__anext__()
            assert sent == [] and set(tm.rid_to_state) <= {"busy"}

    asyncio.run(run())


def test_the_rid_of_a_request_with_n_choices_aborts_and_holds_them_all():
    """Found over HTTP (a helper's review, thirty-fourth session): with n > 1 each choice runs
    as `rid-k`, and /abort_request {"rid": rid} did nothing (both choices ran to their end),
    while a second request with the same rid was admitted. The client's rid now names the
    whole request until generate_request returns."""

    async def run() -> None:
        tm, sent = fake_tokenizer_manager()
        tm._expand = TokenizerManager._expand.__get__(tm)  # the real n > 1 expansion
        tm._sockets_ready = True
        sp = {"n": 2, "max_new_tokens": 4}
        gen = tm.generate_request(GenerateReqInput("t", rid="nr", sampling_params=sp))
        done = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert set(tm.rid_to_state) == {"nr-0", "nr-1"}
        assert tm.rid_groups == {"nr": ["nr-0", "nr-1"]}
        for taken in ("nr", "nr-1"):
            again = tm.generate_request(GenerateReqInput("t", rid=taken))
            with pytest.raises(ValueError, match="already in flight"):
                await again.__anext__()
        single = tm.generate_request(GenerateReqInput("t", rid="solo"))
        solo = asyncio.ensure_future(single.__anext__())
        await asyncio.sleep(0)
        pair = tm.generate_request(GenerateReqInput("t", rid="solo", sampling_params=sp))
        with pytest.raises(ValueError, match="already in flight"):  # its choices are free
            await pair.__anext__()
        sent.clear()
        tm.abort_request("nr")
        assert sorted(m.rid for m in sent if isinstance(m, AbortReq)) == ["nr-0", "nr-1"]
        tm.abort_request("nr-1")  # one choice alone, by its own id
        assert sent[-1].rid == "nr-1"
        for rid in ("nr-0", "nr-1", "solo"):
            tm._handle_batch_out(_out(rid, [], final=True))
        outs = await done
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
        await solo
        await gen.aclose()
        await single.aclose()
        assert tm.rid_groups == {} and tm.rid_to_state == {}
        sent.clear()
        tm.abort_request("nr")  # nothing in flight under it any more
        assert sent == []

    asyncio.run(run())
