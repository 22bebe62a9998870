"""EagleDraftInput: pending target hidden states kept as row ranges of step outputs."""

from __future__ import annotations

import gc
import weakref

import torch

from sglang.srt.speculative.spec_info import COMPACT_CHUNKS, EagleDraftInput


def test_rows_of_many_steps_are_compacted_and_step_outputs_released():
    d = EagleDraftInput()
    steps, want, refs = [], [], []
    for i in range(3 * COMPACT_CHUNKS + 5):
        step = torch.randn(8, 6)  # one step's [R, 3H] hidden states, shared by its requests
        row = i % 8
        d.append_rows(step, row, row + 1, max_pending=1024)
        want.append(step[row].clone())
        refs.append(weakref.ref(step))
        steps.append(step)
    assert d.num_pending == len(want)
    assert len(d.chunks) < COMPACT_CHUNKS  # compacted along the way
    del steps
    gc.collect()
    held = sum(r() is not None for r in refs)
    assert held < COMPACT_CHUNKS  # older step outputs are no longer referenced
    assert torch.equal(d.hidden_states, torch.stack(want))
    assert len(d.chunks) == 1 and d.hidden_states.shape == (len(want), 6)


def test_multi_row_ranges_overflow_and_clear():
    d = EagleDraftInput()
    a, b = torch.arange(40.0).view(10, 4), torch.arange(40.0, 80.0).view(10, 4)
    d.append_rows(a, 2, 5, max_pending=8)
    d.append_rows(b, 0, 0, max_pending=8)  # empty range: nothing
    d.append_rows(b, 7, 10, max_pending=8)
    assert d.num_pending == 6 and len(d.chunks) == 2
    assert torch.equal(d.hidden_states, torch.cat([a[2:5], b[7:10]]))
    d.clear()
    assert d.hidden_states is None and d.num_pending == 0
    d.append_rows(a, 0, 9, max_pending=8)  # beyond the bound: dropped, request goes stale
    assert d.stale and d.hidden_states is None
    d.append_rows(a, 0, 1, max_pending=8)
    assert d.num_pending == 0


def test_requests_compacted_together_keep_their_own_rows_and_release_step_outputs(monkeypatch):
    """SpecScheduler appends without compacting and then compacts every due request together
    (compact_pending: one concatenation of the distinct step outputs, one row gather): each
    request's pending rows stay its own, in order, the step outputs are released, and a later
    draft sees exactly its rows (a view, no copy)."""
    import sglang.srt.speculative.spec_info as spec_info

    cats, gathers = [], []
    real_cat, real_select = torch.cat, torch.Tensor.index_select
    monkeypatch.setattr(spec_info.torch, "cat", lambda xs: cats.append(len(xs)) or real_cat(xs))
    monkeypatch.setattr(
        torch.Tensor,
        "index_select",
        lambda t, d, i: gathers.append(i.numel()) or real_select(t, d, i),
    )
    n_req, n_steps = 5, COMPACT_CHUNKS + 3
    drafts = [EagleDraftInput() for _ in range(n_req)]
    want = [[] for _ in range(n_req)]
    refs = []
    for step_i in range(n_steps):
        step = torch.randn(n_req + 2, 6)  # rows shifted per step, as batches change
        refs.append(weakref.ref(step))
        due = []
        for r, d in enumerate(drafts):
            if r == 4 and step_i < 3:  # request 4 joins three steps later
                continue
            row = (r + step_i) % (n_req + 2)
            d.append_rows(step, row, row + 1, max_pending=1024, compact=False)
            want[r].append(step[row].clone())
            if d.compaction_due:
                due.append(d)
        spec_info.compact_pending(due)
        del step
    # requests 0-3 together (the 16 step outputs they reference), then request 4
    assert cats == [COMPACT_CHUNKS, COMPACT_CHUNKS]
    assert gathers == [4 * COMPACT_CHUNKS, COMPACT_CHUNKS]  # one row gather each
    gc.collect()
    assert sum(r() is not None for r in refs) == 3  # only the 3 newest steps are referenced
    shared = drafts[0].chunks[0][0]
    assert all(d.chunks[0][0] is shared for d in drafts[:4])
    for r, d in enumerate(drafts):
        assert d.num_pending == len(want[r])
        assert torch.equal(d.hidden_states, torch.stack(want[r]))
        assert len(d.chunks) == 1
    one = EagleDraftInput()  # a single range at an offset: a view of its source, no copy
    src = torch.randn(8, 6)
    one.append_rows(src, 2, 5, max_pending=1024)
    assert one.hidden_states.data_ptr() == src[2].data_ptr()
    assert torch.equal(one.hidden_states, src[2:5])


def test_compaction_gathers_only_new_rows_and_drafting_sees_all_in_order(monkeypatch):
    """While a request keeps not drafting, each compaction copies only the rows appended since
    the previous one (a new segment; the row count per gather stays COMPACT_CHUNKS instead of
    growing with the pending rows), and hidden_states (before drafting) joins the segments
    and the newest chunks into one range, in position order."""
    import sglang.srt.speculative.spec_info as spec_info

    gathers = []
    real_select = torch.Tensor.index_select
    monkeypatch.setattr(
        torch.Tensor,
        "index_select",
        lambda t, d, i: gathers.append(i.numel()) or real_select(t, d, i),
    )
    d = EagleDraftInput()
    want = []
    for i in range(4 * COMPACT_CHUNKS + 3):
        step = torch.randn(3, 5)
        d.append_rows(step, i % 3, i % 3 + 1, max_pending=1024, compact=False)
        want.append(step[i % 3].clone())
        if d.compaction_due:
            spec_info.compact_pending([d])
    assert gathers == [COMPACT_CHUNKS] * 4
    assert d.num_compacted == 4 and d.num_uncompacted == 3 and d.num_pending == len(want)
    assert torch.equal(d.hidden_states, torch.stack(want))
    assert len(gathers) == 4 and len(d.chunks) == 1 and d.num_compacted == 1  # joined by slices
    assert d.chunks[0][0].shape[0] == len(want)  # a tensor of its own rows only
    d.clear()
    assert d.num_compacted == 0 and d.hidden_states is None


def test_drafting_request_copies_only_its_rows_of_shared_segments(monkeypatch):
    """Segments are shared by the requests compacted together; when one of them drafts, its
    rows are joined into a tensor of its own rows: the concatenation reads its 48 rows, not
    the 8 x 48 rows of the whole segments."""
    import sglang.srt.speculative.spec_info as spec_info

    drafts = [EagleDraftInput() for _ in range(8)]
    want = [[] for _ in drafts]
    for _ in range(3 * COMPACT_CHUNKS):
        step = torch.randn(len(drafts), 4)
        for r, d in enumerate(drafts):
            d.append_rows(step, r, r + 1, max_pending=1024, compact=False)
            want[r].append(step[r].clone())
        due = [d for d in drafts if d.compaction_due]
        spec_info.compact_pending(due)
    assert all(d.num_compacted == 3 for d in drafts)
    assert drafts[2].chunks[0][0] is drafts[5].chunks[0][0]  # shared segment
    cat_rows = []
    real_cat = torch.cat
    monkeypatch.setattr(
        spec_info.torch, "cat", lambda xs: cat_rows.append(sum(len(x) for x in xs)) or real_cat(xs)
    )
    h = drafts[2].hidden_states
    assert cat_rows == [3 * COMPACT_CHUNKS]
    assert torch.equal(h, torch.stack(want[2])) and h.shape[0] == 3 * COMPACT_CHUNKS
    assert drafts[2].chunks[0][0].shape[0] == 3 * COMPACT_CHUNKS  # not 8 x that
    assert torch.equal(drafts[5].hidden_states, torch.stack(want[5]))  # others unaffected
