"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (issue 6).

A batch-1 decode step is a chain of ~8 kernels per layer, each waiting for the one before it.
Between two kernels the GPU drains the first, launches the second and ramps its memory stream
up again: a few microseconds per boundary, 3-4% of an 8B-shaped step on the H200. Hopper (SM90)
and newer GPUs let a kernel launched with the programmatic-stream-serialization attribute start
before the kernel ahead of it has finished (CUDA Programming Guide, "Programmatic Dependent
Launch and Synchronization"; PTX ``griddepcontrol``); it must then wait
(``griddepcontrol.wait``, Triton's ``tl.extra.cuda.gdc_wait``) before it touches memory the
earlier kernel writes or reads. Triton launches a kernel so when called with
``launch_pdl=True`` (its tutorial 11).

The kernels: the GEMVs (gemv.py, both prologue kernels of gemv_prologue.py, gemv_epilogue.py),
RMSNorm, SiLU-and-mul, the fused RoPE + KV store, the grouped decode and the split-K merge.

The rules every kernel here follows (``pdl_wait``):
- It signals ``launch_dependents`` first, so the next kernel may launch as soon as all of this
  kernel's programs are resident, and then waits for the kernel ahead of it before its first
  load or store. Every kernel launched with the flag waits, so the chain stays ordered: after a
  kernel's wait, every kernel before it has completed and its writes are visible.
- Before its wait a kernel may only read what no kernel of the step writes. The GEMVs can ask
  L2 to prefetch the first columns of their weight rows there (``prefetch_l2``,
  ``prefetch_cols``), so that the weight stream would start under the tail of the kernel
  ahead; SGLANG_GEMV_PREFETCH_MB sets how much, 0 (off) by default since it did not pay.
A kernel launched without the flag (a PyTorch op, FlashInfer) waits for
everything before it, as usual; a flagged kernel after it launches when it completes.

Measured on the H200 (twenty-fifth session, ``scripts/gpu_diagnose.sh GP``, Llama-3.1-8B-shaped
batch-1 decode, ``benchmark/results/decode_roofline_{pdl,pf}*_h200_s25.json``): without PDL
4.242 / 4.256 / 4.269 / 4.259 ms per step; with PDL and no prefetch 4.168 / 4.169 ms (roofline
fraction 0.845 / 0.848); with a prefetch of 2 MiB per GEMV 4.167, 8 MiB 4.479, 16 MiB 4.546
(4.600 when the prefetch marked its lines evict_last), 32 MiB 4.821 ms: the prefetched lines
compete with the weights the GEMV ahead is still streaming, and win nothing back.

``launch_args(t)`` gives the launch keywords: {"USE_PDL": True, "launch_pdl": True} on a CUDA
device of compute capability >= 9 while SGLANG_TRITON_PDL is on (the default) and Triton is not
interpreting (TRITON_INTERPRET), else {"USE_PDL": False} (and no prefetch). Outputs are the same
bit for bit with and without: only launch timing changes.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from sglang.srt.layers.triton_kernels import GEMV_PREFETCH_BYTES, TRITON_PDL_ENABLED

L2_LINE_BYTES = 128  # one prefetch instruction per L2 line
# Triton's interpreter runs neither griddepcontrol nor inline asm. Read once, like triton.jit,
# which reads TRITON_INTERPRET when a kernel is decorated (this module imports triton).
_INTERPRETING: bool = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(t: torch.Tensor) -> bool:
    """True when kernels working on `t` launch with PDL: SGLANG_TRITON_PDL on, `t` on a CUDA
    device of compute capability >= 9 (Hopper and newer), and Triton compiling the kernels
    (its interpreter, TRITON_INTERPRET=1, runs neither griddepcontrol nor inline asm)."""
    if not (TRITON_PDL_ENABLED and t.is_cuda) or _INTERPRETING:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _device_has_pdl(index)


def launch_args(t: torch.Tensor) -> dict[str, bool]:
    """Keywords for launching a kernel with a ``USE_PDL`` constexpr (which calls ``pdl_wait``)
    on `t`'s device: USE_PDL and launch_pdl both True where ``pdl_on(t)``, else USE_PDL False
    and no launch flag. The two always go together: a kernel launched with the flag must wait."""
    if pdl_on(t):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def prefetch_cols(n: int, k: int, elem_bytes: int, use_pdl: bool) -> int:
    """Leading columns of each of the n weight rows ([n, k], elem_bytes per element) that a GEMV
    launched with PDL prefetches into L2 before its wait: the largest power of two with
    n * cols * elem_bytes <= GEMV_PREFETCH_BYTES (SGLANG_GEMV_PREFETCH_MB) and cols <= k, or 0
    when that is under one L2 line (128 bytes) per row, or without PDL (nothing to overlap).
    E.g. 16 MiB over Llama-3.1-8B's bf16 o_proj [4096, 4096]: 2048 columns."""
    line = L2_LINE_BYTES // elem_bytes
    if not use_pdl or n <= 0 or k < line:
        return 0
    cols = min(GEMV_PREFETCH_BYTES // (n * elem_bytes), k)
    if cols < line:
        return 0
    return 1 << (cols.bit_length() - 1)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Let the next kernel launch, then wait until the kernel ahead has completed and its
    writes are visible (module docstring). Nothing when USE_PDL is false."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(w_ptr, offs_n, N, K, PF_K: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 to fetch columns [0, PF_K) of rows offs_n ([BLOCK_N]) of the row-major [N, K]
    weight at w_ptr, one ``prefetch.global.L2`` per LINE elements (128 bytes);
    rows past N repeat row N - 1. Needs PF_K a power-of-two multiple of LINE, PF_K <= K.
    The asm's output register is set to 0 only because inline asm must return a value.
    A hint only: it loads nothing into registers and changes no result."""
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    lines = tl.arange(0, PF_K // LINE) * LINE
    ptrs = w_ptr + rows[:, None] * K + lines[None, :]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
