"""A lean re-plan of FlashInfer CUDA-graph wrappers before each replay.

Why: a graph replays FlashInfer kernels whose schedule lives in device memory (the wrapper's
int workspace), so every replay must re-plan for the step's lengths first. The wrappers'
plan() does that plus checks and copies a replay does not need: it copies the page list into
the wrapper's buffer (ours is filled in place by fill_kv_indices), the last-page lengths (all
ones with one-token pages, set at capture), rebuilds host tensors, recomputes lengths with
torch calls and canonicalises dtypes. On the H200 host py-spy put the decode plan() at 16% of
a SmolLM2 batch-1 server's scheduler time (`serve_pyspy_c1_h200_s14.json`,
FlashInferAttnBackend._plan) and 5% at c = 256 (`serve_pyspy_c256_h200_s16.json`), in a step
that is host-bound. Upstream SGLang replaces the decode call on its replay path for the same
reason (its `fast_decode_plan`).

What a replay needs, and all this does:
- decode (BatchDecodeWithPagedKVCacheWrapper): the step's kv_indptr in the wrapper's device
  buffer (the kernels read it) and the wrapper module's C++ plan over the host indptr (with
  tensor cores: the prefill module's plan, also over the host KV lengths);
- prefill / verify (BatchPrefillWithPagedKVCacheWrapper, causal): qo_indptr, kv_indptr and the
  KV lengths in the wrapper's device buffers, and the C++ plan over their host copies.
The C++ plan writes the schedule to the pinned int workspace and queues its copy to the
device. The arguments mirror flashinfer-python 0.6.18's plan() for wrappers created with
use_cuda_graph=True, page size 1, no sliding window, no soft cap, no custom mask and the fa2
backend, the only wrappers the backend makes; `supported` checks that a wrapper is such a one
and that the installed FlashInfer is a version this was checked against (VALIDATED_VERSIONS),
else the backend keeps calling plan().

On by default (SGLANG_FLASHINFER_LEAN_PLAN=0 keeps plan()) since its GPU tests passed on the
H200 (seventeenth session: lean replays give the reference outputs, the engine's graph and
eager greedy outputs agree): a SmolLM2 batch-1 overlap step took 0.90 ms with it against 1.20
and 1.56 ms with plan() (benchmark/README.md, "seventeenth session").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sglang.srt.layers.attention.paged_layout import PagedLayout
from sglang.srt.server_args import env_flag

VALIDATED_VERSIONS = ("0.6.18",)

# What plan() leaves on a CUDA-graph wrapper that the lean re-plan reads.
_NEEDED = (
    "_cached_module",
    "_float_workspace_buffer",
    "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer",
    "_paged_kv_indptr_buf",
    "_fixed_batch_size",
)
_NEEDED_PREFILL = ("_qo_indptr_buf", "_kv_lens_buffer", "_max_total_num_rows")


def lean_plan_enabled() -> bool:
    """SGLANG_FLASHINFER_LEAN_PLAN: unset or "1" uses the lean re-plan for CUDA-graph
    replays; "0" keeps plan(). Raises ValueError naming the variable on any other value."""
    raw = env_flag("FLASHINFER_LEAN_PLAN", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"SGLANG_FLASHINFER_LEAN_PLAN must be 0 or 1, got {raw!r}")
    return raw == "1"


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except ImportError:
        return None
    return getattr(flashinfer, "__version__", None)


def supported(wrapper: Any, version: str | None = None) -> bool:
    """True when `wrapper` is a CUDA-graph decode or prefill wrapper that plan() has run on once
    (its module is built), of the fa2 backend without a JIT variant, sliding window, soft cap
    or custom mask, under a FlashInfer version in VALIDATED_VERSIONS (version: the installed
    one when None)."""
    version = flashinfer_version() if version is None else version
    prefill = not hasattr(wrapper, "use_tensor_cores")  # the decode wrapper's property
    needed = _NEEDED + (_NEEDED_PREFILL if prefill else ())
    missing = object()

    def attr(name: str) -> Any:
        return getattr(wrapper, name, missing)

    return (
        version in VALIDATED_VERSIONS
        and attr("is_cuda_graph_enabled") is True
        and all(attr(name) not in (None, missing) for name in needed)
        and attr("_backend") == "fa2"
        and attr("_jit_module") is None
        and attr("_window_left") == -1
        and attr("_logits_soft_cap") == 0.0
        and (attr("_custom_mask_buf") is None if prefill else True)
        and (attr("_causal") is True if prefill else attr("_q_len_per_req") == 1)
    )


@dataclass
class PlanInputs:
    """The host tensors a plan() of one step reads ([bs + 1] / [bs] int32, on the CPU)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor | None  # kv_indptr's differences (seq_lens); None for a decode plan


_PINNED_ONES: dict[int, torch.Tensor] = {}


def plan_inputs(layout: PagedLayout, pin: bool, is_decode: bool = False) -> PlanInputs:
    """layout's host tensors for plan(), in pinned memory when `pin` (a CUDA backend); for a
    decode plan (`is_decode`) only those it uploads (kv_indptr, last_page_len) are pinned.

    Why: plan() copies its indptrs, last-page lengths and (prefill) KV lengths to the device
    with non_blocking copies. From pageable memory CUDA may stage such a copy by synchronising
    with the stream (CUDA runtime API, "API synchronization behavior"), i.e. the host waits for
    the step in flight, which is what overlap scheduling exists to avoid; from pinned memory
    the copy is queued. Passing the KV lengths as seq_lens gives plan() the values it would
    compute (get_seq_lens of one-token pages) without a pageable temporary."""
    qo, kv, last = layout.qo_indptr, layout.kv_indptr, layout.last_page_len
    kv_lens = None if is_decode else _kv_lens(kv)  # a decode plan() computes none it uploads
    if pin:
        n = last.numel()
        ones = _PINNED_ONES.get(n)
        if ones is None:
            ones = _PINNED_ONES[n] = last.pin_memory()  # all ones, never written
        kv, last = kv.pin_memory(), ones
        if not is_decode:
            qo, kv_lens = qo.pin_memory(), kv_lens.pin_memory()
    return PlanInputs(qo, kv, last, kv_lens)


def _kv_lens(kv_indptr: torch.Tensor) -> torch.Tensor:
    """[bs] int32 KV lengths (pages of one token) from the [bs + 1] int32 CPU page offsets."""
    return torch.from_numpy(np.diff(kv_indptr.numpy()).astype(np.int32))


def _upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src (a CPU tensor) without making the host wait for the device: into a CUDA
    buffer through pinned memory (one asynchronous copy, ordered on the current stream; the
    caching host allocator keeps the pinned block until the copy ran). plan() copies from
    pageable memory, which CUDA may stage by synchronising with the stream, i.e. wait for the
    step in flight (CUDA runtime API, "API synchronization behavior")."""
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


class GraphReplanner:
    """Re-plans CUDA-graph wrappers for a replay (see the module docstring).

    Args: num_qo_heads, num_kv_heads, head_dim, dtype (q and KV; the wrappers were planned
    with them at capture). `replan(wrapper, kv_indptr)` for a decode wrapper,
    `replan_prefill(wrapper, qo_indptr, kv_indptr)` for a causal prefill / verify one: the
    step's [bs + 1] int32 CPU query-row and page offsets (PagedLayout), bs being the wrapper's
    fixed batch size; both raise ValueError for another length.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype) -> None:
        self.nq, self.nkv, self.d = num_qo_heads, num_kv_heads, head_dim
        # plan() of the CUDA-core module takes empty tensors of the q / KV dtypes
        self._empty = torch.empty(0, dtype=dtype)
        self._qo_indptr: dict[int, torch.Tensor] = {}  # bs -> arange(bs + 1) int32, host

    @staticmethod
    def _batch_size(wrapper: Any, *indptrs: torch.Tensor) -> int:
        bs = wrapper._fixed_batch_size
        for t in indptrs:
            if t.numel() != bs + 1:
                raise ValueError(
                    f"lean re-plan: an indptr has {t.numel()} entries, the graph wrapper is "
                    f"for batch size {bs}"
                )
        return bs

    def replan(self, wrapper: Any, kv_indptr: torch.Tensor) -> None:
        bs = self._batch_size(wrapper, kv_indptr)
        # the kernels read the page offsets from the wrapper's device buffer
        _upload(wrapper._paged_kv_indptr_buf, kv_indptr)
        ws = (
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
        )
        if wrapper.use_tensor_cores:  # the prefill module's plan, one query per request
            kv_lens = _kv_lens(kv_indptr)
            qo = self._qo_indptr.get(bs)
            if qo is None:
                qo = self._qo_indptr[bs] = torch.arange(bs + 1, dtype=torch.int32)
            wrapper._plan_info = wrapper._cached_module.plan(
                *ws, qo, kv_indptr, kv_lens,
                bs, bs, self.nq, self.nkv, 1, True, self.d, self.d,
                False, -1,  # causal, window_left
                -1, False, 0, 0,  # fixed_split_size, disable_split_kv, colocated CTAs, q len
            )  # fmt: skip
            wrapper._max_kv_len = int(kv_lens.max()) if bs else 0
        else:
            wrapper._plan_info = wrapper._cached_module.plan(
                *ws, kv_indptr,
                bs, self.nq, self.nkv, 1, True,
                -1, 0.0,  # window_left, logits_soft_cap
                self.d, self.d, self._empty, self._empty,
            )  # fmt: skip

    def replan_prefill(
        self, wrapper: Any, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor
    ) -> None:
        bs = self._batch_size(wrapper, qo_indptr, kv_indptr)
        qo = qo_indptr.numpy()
        rows = int(qo[-1])
        if rows > wrapper._max_total_num_rows:
            raise ValueError(
                f"lean re-plan: {rows} query rows exceed the graph's {wrapper._max_total_num_rows}"
            )
        kv_lens = _kv_lens(kv_indptr)
        _upload(wrapper._qo_indptr_buf, qo_indptr)
        _upload(wrapper._paged_kv_indptr_buf, kv_indptr)
        # read by none of the fa2 kernels, kept as plan() leaves it
        _upload(wrapper._kv_lens_buffer[:bs], kv_lens)
        wrapper._qo_indptr_last = rows
        wrapper._max_q_len = int(np.diff(qo).max()) if bs else 0
        wrapper._max_kv_len = int(kv_lens.max()) if bs else 0
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
            qo_indptr, kv_indptr, kv_lens,
            wrapper._max_total_num_rows, bs, self.nq, self.nkv, 1, True, self.d, self.d,
            True, -1,  # causal, window_left
            -1, False, 0, 0,  # fixed_split_size, disable_split_kv, colocated CTAs, q len
        )  # fmt: skip
