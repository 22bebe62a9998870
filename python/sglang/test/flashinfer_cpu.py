"""FlashInfer CUDA-graph wrappers built on the CPU, for checking and timing the Python of their
plan() without a GPU (test_flashinfer_replan.py, benchmark/bench_flashinfer_replan.py)."""

from __future__ import annotations

from typing import Any

import torch


def graph_wrapper_on_cpu(cls: type, module: Any, **kwargs: Any) -> Any:
    """A CUDA-graph wrapper of FlashInfer class `cls` (use_cuda_graph=True, NHD, a 1 MiB
    workspace, `kwargs` for the rest) over CPU buffers: its pinned int workspace is plain
    memory, there being no pinned allocator without CUDA. plan() takes `module` as the
    wrapper's compiled module (an object with a plan(*args) method) instead of compiling one."""
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kw: Any) -> torch.Tensor:
        return real_empty(*args, **kw)

    torch.empty = empty
    try:
        w = cls(torch.zeros(1 << 20, dtype=torch.uint8), "NHD", use_cuda_graph=True, **kwargs)
    finally:
        torch.empty = real_empty
    w._jit_module = module
    return w
