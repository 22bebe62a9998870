"""BatchStrOut carries each streamed request's new text only (text_offset + text), so a step's
message stays small whatever the output length; the receiver's text equals the scheduler's."""

from __future__ import annotations

from sglang.srt.managers.io_struct import BatchStrOut
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit


def test_streamed_messages_carry_text_deltas(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, disable_overlap_schedule=True)
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    submit(sched, "s", list(range(10, 40)), params, stream=True)
    messages: list[BatchStrOut] = []
    while not sched.is_idle():
        sched.step()
        messages += [m for m in sched.outputs.local_outbox if isinstance(m, BatchStrOut)]
        sched.outputs.local_outbox.clear()
    text, offsets, sizes = "", [], []
    for m in messages:
        for i, rid in enumerate(m.rids):
            if rid == "s":
                offsets.append(m.text_offset[i])
                sizes.append(len(m.text[i]))
                assert m.text_offset[i] == len(text)  # each message continues the last
                text = m.apply_text_delta(i, text)
    assert len(offsets) >= 20 and sum(sizes) == len(text) > 0
    want = sched.tokenizer.decode(
        [
            t
            for m in messages
            for i, r in enumerate(m.rids)
            if r == "s"
            for t in m.output_ids_delta[i]
        ],
        skip_special_tokens=True,
    )
    assert text == want


def test_full_text_messages_still_apply():
    """A message without text_offset (full text) replaces the text; with offsets it cuts and
    appends (the resend case, offset 0, replaces too)."""
    full = BatchStrOut(["r"], ["abc"], [[1]], [None], [{}])
    assert full.apply_text_delta(0, "zzzz") == "abc"
    delta = BatchStrOut(["r"], ["de"], [[2]], [None], [{}], text_offset=[3])
    assert delta.apply_text_delta(0, "abcX") == "abcde"
    resend = BatchStrOut(["r"], ["xy"], [[3]], [None], [{}], text_offset=[0])
    assert resend.apply_text_delta(0, "abc") == "xy"


def test_receiver_text_unchanged_through_run_until_idle(tiny_model_dir):
    """scheduler_utils.collect rebuilds the same text from the deltas as a non-streamed run."""
    outs_stream: dict = {}
    outs_plain: dict = {}
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    for stream, outs in ((True, outs_stream), (False, outs_plain)):
        sched = make_scheduler(tiny_model_dir, disable_overlap_schedule=True)
        submit(sched, "r", list(range(50, 70)), params, stream=stream)
        run_until_idle(sched, outs)
    assert outs_stream["r"]["text"] == outs_plain["r"]["text"]
    assert outs_stream["r"]["output_ids"] == outs_plain["r"]["output_ids"]
