"""BatchStrOut carries each streamed request's new text only (text_offset + text), so a step's
message stays small whatever the output length; the receiver's text equals the scheduler's. A
speculative server's messages carry each request's counters, the accept histogram only after
it changed."""

from __future__ import annotations

import json

from sglang.srt.managers.io_struct import BatchStrOut, merge_spec, spec_meta
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


def _spec_messages(tiny_model_dir, draft_dir, **kw) -> tuple[list, object]:
    """The (rid "s") SpecCounters of every message of one streamed speculative request, and the
    finished request."""
    sched = make_scheduler(
        tiny_model_dir,
        dtype="float32",
        disable_overlap_schedule=True,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=2,
        **kw,
    )
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    submit(sched, "s", list(range(10, 40)), params, stream=True)
    counters, reqs = [], {}
    while not sched.is_idle():
        reqs.update({r.rid: r for r in sched.running})
        sched.step()
        for m in sched.outputs.local_outbox:
            if isinstance(m, BatchStrOut):
                assert len(m.spec) == len(m.rids)  # a speculative server's messages carry them
                counters += [m.spec[i] for i, rid in enumerate(m.rids) if rid == "s"]
        sched.outputs.local_outbox.clear()
    return counters, reqs["s"]


def test_spec_counters_send_the_histogram_only_after_it_changed(tiny_model_dir, draft_dir):
    """Each message carries the request's verify / accepted / proposed counts, and its accept
    histogram only when a drafting step changed it since the previous message (always with
    static K; once, in the first message, when nothing drafts); merge_spec fills the gaps and
    spec_meta's keys equal the request's own counters."""
    never = json.dumps({"time_model": {"verify_tokens": 1.0}, "online_correction": False})
    static, req = _spec_messages(tiny_model_dir, draft_dir)
    assert len(static) >= 4 and static[0][3] is not None
    for prev, c in zip(static, static[1:], strict=False):  # drafted since the last message
        assert (c[3] is not None) == (c[2] > prev[2])
    merged = None
    for c in static:
        merged = merge_spec(merged, c)
    assert merged[3] == tuple(req.spec_accept_histogram) and sum(merged[3]) >= 4
    plain, req = _spec_messages(
        tiny_model_dir,
        draft_dir,
        speculative_adaptive=True,
        speculative_adaptive_config=never,
    )
    assert plain[0][3] == (0, 0, 0) and all(c[3] is None for c in plain[1:])
    merged = None
    for c in plain:
        merged = merge_spec(merged, c)
    meta = spec_meta(merged, len(req.output_ids))
    assert meta["spec_verify_ct"] == req.spec_verify_ct == len(req.output_ids) - 1
    assert meta["spec_accept_histogram"] == [0, 0, 0] and meta["spec_num_proposed_drafts"] == 0
    assert meta["spec_accept_length"] == len(req.output_ids) / req.spec_verify_ct
    # a message without one for a state that never had one (a stray message for a reused
    # rid, test_tokenizer_manager_spec_stray.py) gives no histogram, and no error
    assert merge_spec(None, plain[1]) == plain[1]
    assert spec_meta(plain[1], 3)["spec_accept_histogram"] == []
