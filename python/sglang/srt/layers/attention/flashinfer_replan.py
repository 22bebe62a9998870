"""A lean re-plan of a FlashInfer CUDA-graph decode wrapper before each replay.

Why: a decode graph replays FlashInfer kernels whose schedule lives in device memory (the
wrapper's int workspace), so every replay must re-plan for the step's lengths first.
`BatchDecodeWithPagedKVCacheWrapper.plan()` does that plus checks and copies a replay does not
need: it copies the page list into the wrapper's buffer (ours is filled in place by
fill_kv_indices), the last-page lengths (all ones with one-token pages, set at capture),
rebuilds host tensors, recomputes lengths with torch calls and canonicalises dtypes. On the
H200 host py-spy put that Python at 16% of a SmolLM2 batch-1 server's scheduler time
(`serve_pyspy_c1_h200_s14.json`, FlashInferAttnBackend._plan) and 5% at c = 256
(`serve_pyspy_c256_h200_s16.json`), in a step that is host-bound. Upstream SGLang replaces the
same call on its replay path for the same reason (its `fast_decode_plan`).

What a replay needs, and all this does: the step's kv_indptr in the wrapper's device buffer
(the kernels read it) and the wrapper module's C++ plan over the host indptr (and, with tensor
cores, the host KV lengths), which writes the schedule to the pinned int workspace and queues
its copy to the device. The arguments mirror flashinfer-python 0.6.18's plan() for a wrapper
created with use_cuda_graph=True, page size 1, no sliding window, no soft cap and the fa2
backend, the only wrappers the backend makes; `supported` checks that a wrapper is such a one
and that the installed FlashInfer is a version this was checked against (VALIDATED_VERSIONS),
else the backend keeps calling plan().

Opt-in with SGLANG_FLASHINFER_LEAN_PLAN=1 until the GPU tests of test_flashinfer_backend.py
(lean and full plans give the same schedule and the same attention output) have run on the
H200.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sglang.srt.server_args import env_flag

VALIDATED_VERSIONS = ("0.6.18",)

# What plan() leaves on a CUDA-graph decode wrapper that the lean re-plan reads.
_NEEDED = (
    "_cached_module",
    "_float_workspace_buffer",
    "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer",
    "_paged_kv_indptr_buf",
    "_fixed_batch_size",
    "use_tensor_cores",
)


def lean_plan_enabled() -> bool:
    """SGLANG_FLASHINFER_LEAN_PLAN: "1" uses the lean re-plan for CUDA-graph decode replays;
    unset or "0" keeps plan(). Raises ValueError naming the variable on any other value."""
    raw = env_flag("FLASHINFER_LEAN_PLAN", "0").strip()
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
    """True when `wrapper` is a CUDA-graph decode wrapper that plan() has run on once (its
    module is built), of the fa2 backend without a JIT variant, under a FlashInfer version in
    VALIDATED_VERSIONS (version: the installed one when None)."""
    version = flashinfer_version() if version is None else version
    return (
        version in VALIDATED_VERSIONS
        and bool(getattr(wrapper, "is_cuda_graph_enabled", False))
        and all(getattr(wrapper, name, None) is not None for name in _NEEDED)
        and getattr(wrapper, "_backend", "fa2") in ("fa2", "auto")
        and getattr(wrapper, "_jit_module", None) is None
        and getattr(wrapper, "_window_left", -1) == -1
        and not getattr(wrapper, "_logits_soft_cap", 0.0)
    )


class DecodeReplanner:
    """Re-plans CUDA-graph decode wrappers for a replay (see the module docstring).

    Args: num_qo_heads, num_kv_heads, head_dim, dtype (q and KV; the wrapper was planned with
    them at capture). Call `replan(wrapper, kv_indptr)` with kv_indptr the step's [bs + 1]
    int32 CPU page offsets (PagedLayout.kv_indptr), bs being the wrapper's fixed batch size;
    raises ValueError for another length.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype) -> None:
        self.nq, self.nkv, self.d = num_qo_heads, num_kv_heads, head_dim
        # plan() of the CUDA-core module takes empty tensors of the q / KV dtypes
        self._empty = torch.empty(0, dtype=dtype)
        self._qo_indptr: dict[int, torch.Tensor] = {}  # bs -> arange(bs + 1) int32, host

    def replan(self, wrapper: Any, kv_indptr: torch.Tensor) -> None:
        bs = wrapper._fixed_batch_size
        if kv_indptr.numel() != bs + 1:
            raise ValueError(
                f"lean re-plan: kv_indptr has {kv_indptr.numel()} entries, the graph wrapper "
                f"is for batch size {bs}"
            )
        # the kernels read the page offsets from the wrapper's device buffer
        wrapper._paged_kv_indptr_buf.copy_(kv_indptr, non_blocking=True)
        ws = (
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
        )
        if wrapper.use_tensor_cores:  # the prefill module's plan, one query per request
            kv_lens = torch.from_numpy(np.diff(kv_indptr.numpy()).astype(np.int32))
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
