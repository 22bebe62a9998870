"""flashinfer_replan against flashinfer-python's own plan(), on the CPU.

CUDA-graph wrappers are built over CPU buffers (their pinned workspace as plain memory) and
their module replaced by a recorder, so that FlashInfer's real plan() runs up to the C++
call. The lean re-plan must hand that call the same arguments for the same step and leave the
same offsets and lengths in the wrapper's buffers: decode with and without tensor cores, and
causal prefill / verify steps (ragged query lengths, padded token rows). The GPU side (the
attention outputs of lean replays) is test_flashinfer_backend.py's
test_cuda_graph_replay_with_padding_equals_eager with lean=True.
"""

from __future__ import annotations

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")

from sglang.srt.layers.attention import flashinfer_replan  # noqa: E402
from sglang.srt.layers.attention.paged_layout import paged_layout  # noqa: E402
from sglang.test.flashinfer_cpu import graph_wrapper_on_cpu  # noqa: E402

NQ, HEAD_DIM, BS = 8, 64, 3


class Recorder:
    """Stands for the wrapper's compiled module: records plan() arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def plan(self, *args):
        self.calls.append(args)
        return [7, len(self.calls)]  # a plan_info


def graph_wrapper(use_tc: bool):
    """A CUDA-graph decode wrapper as the backend builds them (fa2, batch size BS), planned
    through a Recorder."""
    return graph_wrapper_on_cpu(
        flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        Recorder(),
        use_tensor_cores=use_tc,
        paged_kv_indptr_buffer=torch.zeros(BS + 1, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(4096, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.ones(BS, dtype=torch.int32),
        backend="fa2",
    )


def prefill_graph_wrapper():
    """A CUDA-graph prefill wrapper for BS requests, planned through a Recorder."""
    return graph_wrapper_on_cpu(
        flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        Recorder(),
        qo_indptr_buf=torch.zeros(BS + 1, dtype=torch.int32),
        paged_kv_indptr_buf=torch.zeros(BS + 1, dtype=torch.int32),
        paged_kv_indices_buf=torch.zeros(4096, dtype=torch.int32),
        paged_kv_last_page_len_buf=torch.ones(BS, dtype=torch.int32),
        backend="fa2",
    )


def full_prefill_plan(w, seq_lens: list[int], ext: list[int], rows: int, nkv: int) -> None:
    """The backend's plan() call for a prefill / verify replay (FlashInferAttnBackend._plan)."""
    layout = paged_layout(seq_lens, ext, rows)
    w.plan(
        layout.qo_indptr, layout.kv_indptr, w._paged_kv_indices_buf[: layout.num_pages],
        layout.last_page_len, NQ, nkv, HEAD_DIM, 1, causal=True, non_blocking=True,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=0.125,
    )  # fmt: skip


def full_plan(w, seq_lens: list[int], nkv: int) -> None:
    """The backend's plan() call for a decode replay (FlashInferAttnBackend._plan)."""
    layout = paged_layout(seq_lens, [1] * len(seq_lens), len(seq_lens))
    indices = w._paged_kv_indices_buf[: layout.num_pages]
    w.plan(
        layout.kv_indptr, indices, layout.last_page_len, NQ, nkv, HEAD_DIM, 1,
        non_blocking=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        sm_scale=0.125,
    )  # fmt: skip


def same_args(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype):
                return False
            if x.numel() > 4096:  # a workspace: the wrapper's own buffer, by shape
                if x.shape != y.shape:
                    return False
            elif not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("use_tc", [False, True])
def test_lean_replan_calls_the_module_like_plan(use_tc):
    nkv = 2 if use_tc else 4  # GQA 4 decodes on tensor cores (upstream's rule), 2 on CUDA cores
    full = graph_wrapper(use_tc)
    lean = graph_wrapper(use_tc)
    capture = [1, 1, 1]
    full_plan(full, capture, nkv)
    full_plan(lean, capture, nkv)  # the capture's plan()
    lean._jit_module = None  # as built without a JIT variant: plan() kept the module
    lean._cached_module = lean_rec = Recorder()
    assert flashinfer_replan.supported(lean, version="0.6.18")
    replanner = flashinfer_replan.GraphReplanner(NQ, nkv, HEAD_DIM, torch.bfloat16)
    for seq_lens in ([5, 40, 300], [17, 2, 130], [1, 1, 4096 - 2]):
        full_plan(full, seq_lens, nkv)
        layout = paged_layout(seq_lens, [1] * BS, BS)
        replanner.replan(lean, layout.kv_indptr)
        assert same_args(lean_rec.calls[-1], full._jit_module.calls[-1])
        assert torch.equal(lean._paged_kv_indptr_buf, full._paged_kv_indptr_buf)
        assert lean._plan_info == [7, len(lean_rec.calls)]
        if use_tc:
            assert lean._max_kv_len == full._max_kv_len == max(seq_lens)
    with pytest.raises(ValueError, match="batch size 3"):
        replanner.replan(lean, torch.zeros(BS + 2, dtype=torch.int32))


def test_lean_prefill_replan_calls_the_module_like_plan():
    rows, nkv = 12, 2  # the graph's token rows (verify of up to 4 tokens per request)
    full = prefill_graph_wrapper()
    lean = prefill_graph_wrapper()
    capture = ([4] * BS, [4] * BS)  # every request computes 4 tokens from position 0
    full_prefill_plan(full, *capture, rows, nkv)
    full_prefill_plan(lean, *capture, rows, nkv)
    lean._jit_module = None
    lean._cached_module = lean_rec = Recorder()
    assert flashinfer_replan.supported(lean, version="0.6.18")
    replanner = flashinfer_replan.GraphReplanner(NQ, nkv, HEAD_DIM, torch.bfloat16)
    steps = [  # (seq_lens, extend lens): ragged verify, one padded row, a prefill chunk
        ([9, 22, 35], [1, 3, 2]),
        ([4, 61, 8], [1, 4, 4]),
        ([300, 2, 1000], [2, 2, 4]),
    ]
    for seq_lens, ext in steps:
        full_prefill_plan(full, seq_lens, ext, rows, nkv)
        layout = paged_layout(seq_lens, ext, rows)
        replanner.replan_prefill(lean, layout.qo_indptr, layout.kv_indptr)
        assert same_args(lean_rec.calls[-1], full._jit_module.calls[-1])
        for buf in ("_qo_indptr_buf", "_paged_kv_indptr_buf"):
            assert torch.equal(getattr(lean, buf), getattr(full, buf)), buf
        # the KV lengths: the first BS entries (the rest of the buffer is never written)
        assert torch.equal(lean._kv_lens_buffer[:BS], full._kv_lens_buffer[:BS])
        assert (lean._max_q_len, lean._max_kv_len, lean._qo_indptr_last) == (
            full._max_q_len,
            full._max_kv_len,
            full._qo_indptr_last,
        )
    with pytest.raises(ValueError, match="query rows exceed"):
        layout = paged_layout([20, 20, 20], [1, 1, 1], rows + 1)
        replanner.replan_prefill(lean, layout.qo_indptr, layout.kv_indptr)


def test_supported_only_for_planned_graph_wrappers_of_checked_versions():
    w = graph_wrapper(use_tc=False)
    assert not flashinfer_replan.supported(w, version="0.6.18")  # plan() has not run yet
    full_plan(w, [1, 1, 1], 4)
    assert not flashinfer_replan.supported(w, version="0.6.18")  # a JIT module
    w._jit_module = None
    assert flashinfer_replan.supported(w, version="0.6.18")
    assert not flashinfer_replan.supported(w, version="0.7.0")
    w._window_left = 128
    assert not flashinfer_replan.supported(w, version="0.6.18")
    w._window_left = -1
    w._use_cuda_graph = False
    assert not flashinfer_replan.supported(w, version="0.6.18")


def test_the_flag_reads_0_or_1_and_defaults_to_on(monkeypatch):
    monkeypatch.delenv("SGLANG_FLASHINFER_LEAN_PLAN", raising=False)
    assert flashinfer_replan.lean_plan_enabled()
    monkeypatch.setenv("SGLANG_FLASHINFER_LEAN_PLAN", "0")
    assert not flashinfer_replan.lean_plan_enabled()
    monkeypatch.setenv("SGLANG_FLASHINFER_LEAN_PLAN", "1")
    assert flashinfer_replan.lean_plan_enabled()
    monkeypatch.setenv("SGLANG_FLASHINFER_LEAN_PLAN", "yes")
    with pytest.raises(ValueError, match="SGLANG_FLASHINFER_LEAN_PLAN"):
        flashinfer_replan.lean_plan_enabled()


@pytest.mark.parametrize("kind", ["decode", "decode_tensor_cores", "prefill"])
def test_plan_inputs_give_plan_what_it_computed_itself(kind):
    """The backend's plan() now reads plan_inputs (pinned on CUDA; KV lengths passed as
    seq_lens): FlashInfer must plan exactly as from the layout's own tensors."""
    nkv, rows = 2, 12
    seq_lens, ext = ([5, 40, 300], [1, 1, 1]) if kind != "prefill" else ([9, 22, 35], [1, 3, 2])
    if kind == "prefill":
        a, b = (prefill_graph_wrapper() for _ in range(2))
    else:
        a, b = (graph_wrapper(kind == "decode_tensor_cores") for _ in range(2))
    layout = paged_layout(seq_lens, ext, rows if kind == "prefill" else BS)
    host = flashinfer_replan.plan_inputs(layout, pin=False)
    pages = layout.kv_indptr[1:] - layout.kv_indptr[:-1]  # the padded rows' pages: the last's
    assert torch.equal(host.kv_lens, pages)
    kw = dict(non_blocking=True, q_data_type=torch.bfloat16, sm_scale=0.125)
    if kind == "prefill":
        full_prefill_plan(a, seq_lens, ext, rows, nkv)
        b.plan(
            host.qo_indptr, host.kv_indptr, b._paged_kv_indices_buf[: layout.num_pages],
            host.last_page_len, NQ, nkv, HEAD_DIM, 1, causal=True, seq_lens=host.kv_lens, **kw,
        )  # fmt: skip
        bufs = ("_qo_indptr_buf", "_paged_kv_indptr_buf")
        assert torch.equal(a._kv_lens_buffer[:BS], b._kv_lens_buffer[:BS])
    else:
        full_plan(a, seq_lens, nkv)
        b.plan(
            host.kv_indptr, b._paged_kv_indices_buf[: layout.num_pages], host.last_page_len,
            NQ, nkv, HEAD_DIM, 1, **kw,
        )  # fmt: skip
        bufs = ("_paged_kv_indptr_buf", "_paged_kv_last_page_len_buf")
    assert same_args(a._jit_module.calls[-1], b._jit_module.calls[-1])
    for buf in bufs:
        assert torch.equal(getattr(a, buf), getattr(b, buf)), buf
