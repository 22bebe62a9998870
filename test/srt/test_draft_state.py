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
