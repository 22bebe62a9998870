"""Fused Triton kernels for the CUDA path (RMSNorm with residual add, SiLU-and-mul, RoPE, KV
store), and a GEMV for the linear layers at one row.

The layers in ``sglang.srt.layers`` call these only when ``use_triton_kernels(tensor, ...)`` is
true: the tensor is on CUDA, triton is importable, SGLANG_DISABLE_TRITON_KERNELS is not set and
autograd is not recording through any of the given tensors (the kernels have no backward: draft
training, ``sglang.train_eagle3``, runs the same layers with gradients). Otherwise the plain
PyTorch code runs (the CPU path, which is also the tests' reference).
The linear layers and the lm_head call the Triton GEMV (gemv.py) only when
``use_triton_gemv(x, weight)`` is true; SGLANG_TRITON_GEMV=0 turns it off (on by default since
the H200 measured it: Llama-3.1-8B-shaped batch-1 decode 4.97 -> 4.54 ms per step, roofline
fraction 0.71 -> 0.77; SmolLM2 batch 1 / 8 +2% / +6% tokens/s; benchmark/results/*_r8). It
takes one row unless SGLANG_TRITON_GEMV_MAX_ROWS raises that to up to 8 (the kernel takes 8;
the default stays 1: on the H200 it at best ties cuBLAS at M = 2..8, gemv_rows1-8_h200_s21.json).
Where the GEMV applies, ``use_fused_gemv_prologue`` can also let it compute its own input
(gemv_prologue.py: RMSNorm before qkv/gate_up, SiLU-and-mul before down; layers/fused_linear.py):
the RMSNorm one by default (its scaled kernel), the SiLU one only where
SGLANG_FUSED_GEMV_PROLOGUE names it (1 / all, norm, silu; 0 turns both off), since it made the
8B-shaped batch-1 decode slower on the H200.
RoPE fused with the KV store (rope_kv.py) runs where ``use_fused_rope_kv(q)`` is true and the
layer's step qualifies (layers/fused_rope_kv.py); SGLANG_FUSED_ROPE_KV=0 turns only it off.
The kernel modules import triton, so they are imported lazily, never on a CPU-only run.

Variants: Triton compiles a kernel again for each new combination of its integer arguments'
properties (== 1, divisible by 16), its pointers' 16-byte alignment and its constexprs. A
compile takes 0.2-0.5 s, and one that first happens while serving stalls every request. So
arguments that change from step to step are not specialized: index vectors read one element
at a time (positions, KV slots, seeds), which are views at offsets that follow the step's
shape, and counts that follow the batch size (``do_not_specialize``,
``do_not_specialize_on_alignment``). attention/paged_layout.py's page-list kernel, whose
variants the H200 measured being compiled under load, does the same, and so do the Triton
attention and greedy verify kernels for their per-request index vectors (a draft catch-up
over an odd number of positions moved them off alignment: docs/gpu_fast_path.md).
"""

from __future__ import annotations

import importlib.util

import torch

from sglang.srt.server_args import env_flag

# How the SGLANG_* switches below spell on and off (compared lower-cased and stripped).
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _switch(name: str, default: bool) -> bool:
    """The on / off switch SGLANG_<name>: one of _ON or _OFF (any case, stripped), `default`
    when unset or "". Raises ValueError naming the variable for any other value."""
    flag = env_flag(name).strip().lower()
    if flag not in ("", *_ON, *_OFF):
        raise ValueError(f"SGLANG_{name}={flag!r}: expected 0 or 1")
    return default if flag == "" else flag in _ON


def _triton_enabled() -> bool:
    if env_flag("DISABLE_TRITON_KERNELS").strip().lower() in _ON:
        return False
    return importlib.util.find_spec("triton") is not None


# Decided once at import: triton is installed and SGLANG_DISABLE_TRITON_KERNELS is not set.
TRITON_KERNELS_ENABLED: bool = _triton_enabled()


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """True when autograd records an op on these tensors (grad mode on and one of them requires
    grad): the Triton kernels have no backward, so such an op must stay in PyTorch."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def use_triton_kernels(tensor: torch.Tensor, *more: torch.Tensor | None) -> bool:
    """True when the fused Triton kernels should handle this op on `tensor` (and `more`, the
    op's other tensor inputs and weights): CUDA, enabled, and no gradient to record."""
    return TRITON_KERNELS_ENABLED and tensor.is_cuda and not needs_autograd(tensor, *more)


def _triton_gemv_enabled() -> bool:
    flag = env_flag("TRITON_GEMV").strip().lower()
    return _triton_enabled() and flag not in _OFF


# Decided once at import: the Triton kernels are enabled and SGLANG_TRITON_GEMV is not "0".
TRITON_GEMV_ENABLED: bool = _triton_gemv_enabled()

_GEMV_DTYPES = (torch.float16, torch.bfloat16)

# Rows of x one gemv.gemv call takes (its MAX_ROWS); the ceiling of SGLANG_TRITON_GEMV_MAX_ROWS.
GEMV_KERNEL_MAX_ROWS = 8


def _triton_gemv_max_rows() -> int:
    """SGLANG_TRITON_GEMV_MAX_ROWS: the most rows (after flattening) the layers and the lm_head
    send to the Triton GEMV; unset or "" means 1. Raises ValueError naming the variable for
    anything but an integer in 1..GEMV_KERNEL_MAX_ROWS (SGLANG_TRITON_GEMV=0 turns it off)."""
    flag = env_flag("TRITON_GEMV_MAX_ROWS").strip()
    if flag == "":
        return 1
    try:
        rows = int(flag)
    except ValueError:
        rows = 0
    if not 1 <= rows <= GEMV_KERNEL_MAX_ROWS:
        raise ValueError(
            f"SGLANG_TRITON_GEMV_MAX_ROWS={flag!r}: expected an integer in "
            f"1..{GEMV_KERNEL_MAX_ROWS} (SGLANG_TRITON_GEMV=0 turns the GEMV off)"
        )
    return rows


# Decided once at import; 1 by default: at M = 2 cuBLAS read the Llama-3.1-8B weights faster
# than the GEMV's elementwise kernel on 4 of 5 shapes on the H200
# (benchmark/results/gemv_rows2_h200_s9.json), and the tl.dot kernel for M = 3..8 at best tied
# it (benchmark/bench_gemv.py --rows 1 2 3 4 6 8, benchmark/results/gemv_rows1-8_h200_s21.json).
TRITON_GEMV_MAX_ROWS: int = _triton_gemv_max_rows()


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None) -> bool:
    """The device-free part of use_triton_gemv: x [..., K] has 1..max_rows rows once its leading
    dims are flattened and a unit stride along K, x and weight are both float16 or both bfloat16,
    and weight is a contiguous [N, K]. max_rows None means TRITON_GEMV_MAX_ROWS
    (SGLANG_TRITON_GEMV_MAX_ROWS, 1 by default: two rows, a batch-1 verify of one draft token,
    stay on F.linear, which cuBLAS ran faster at M = 2; see TRITON_GEMV_MAX_ROWS)."""
    if x.dim() == 0 or x.shape[-1] == 0:
        return False
    limit = TRITON_GEMV_MAX_ROWS if max_rows is None else max_rows
    return (
        1 <= x.numel() // x.shape[-1] <= min(limit, GEMV_KERNEL_MAX_ROWS)
        and x.stride(-1) == 1
        and weight.dim() == 2
        and weight.shape[1] == x.shape[-1]
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    )


def use_triton_gemv(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None) -> bool:
    """True when ``x @ weight.T`` should go to the Triton GEMV (``gemv.gemv``): the GEMV is
    enabled (SGLANG_TRITON_GEMV not "0"), x is on CUDA and gemv_applies(x, weight, max_rows)
    (at most SGLANG_TRITON_GEMV_MAX_ROWS rows unless max_rows says otherwise). Anything else
    stays on F.linear / torch.matmul (which raise their own errors on bad shapes), and so does
    an op autograd records (needs_autograd)."""
    return (
        TRITON_GEMV_ENABLED
        and x.is_cuda
        and gemv_applies(x, weight, max_rows)
        and not needs_autograd(x, weight)
    )


GEMV_PROLOGUE_KINDS = ("norm", "silu")
# On by default: the RMSNorm prologue with its scaled kernel (gemv_prologue.py). On the H200
# (twenty-fourth session, ABAB, decode_roofline_np*_h200_s24.json) the Llama-3.1-8B-shaped
# batch-1 decode took 4.243 / 4.246 ms per step with it against 4.254 / 4.255 without, and
# SmolLM2's batch-1 decode graph 0.660 against 0.698 ms (decode_step_smollm2_bs1_np*). The SiLU
# prologue stays off: it made the 8B step slower (4.78 against 4.47 ms, fourteenth session).
DEFAULT_GEMV_PROLOGUES = frozenset({"norm"})


def _fused_gemv_prologues() -> frozenset[str]:
    """The GEMV prologues SGLANG_FUSED_GEMV_PROLOGUE turns on: unset or "" the RMSNorm one
    (DEFAULT_GEMV_PROLOGUES); "0", "off", "false", "no" none; "1", "on", "true", "yes", "all"
    both; else a comma list of "norm" (RMSNorm before qkv_proj / gate_up_proj) and "silu"
    (SiLU-and-mul before down_proj).
    Raises ValueError naming the variable for any other value."""
    flag = env_flag("FUSED_GEMV_PROLOGUE").strip().lower()
    if flag == "":
        return DEFAULT_GEMV_PROLOGUES
    if flag in _OFF:
        return frozenset()
    if flag in (*_ON, "all"):
        return frozenset(GEMV_PROLOGUE_KINDS)
    kinds = frozenset(k.strip() for k in flag.split(",") if k.strip())
    unknown = sorted(kinds - set(GEMV_PROLOGUE_KINDS))
    if unknown or not kinds:
        raise ValueError(
            f"SGLANG_FUSED_GEMV_PROLOGUE={flag!r}: expected 0, 1, all, or a comma list of "
            f"{', '.join(GEMV_PROLOGUE_KINDS)} (unknown: {', '.join(unknown) or 'empty list'})"
        )
    return kinds


# Decided once at import (DEFAULT_GEMV_PROLOGUES unless SGLANG_FUSED_GEMV_PROLOGUE says
# otherwise). The exact RMSNorm kernel and both prologues together were slower on the H200 (5.59
# ms per step against 4.51 without, fourteenth session; decode_roofline_prologue*_h200_s14.json).
# The GEMV's own switches still apply (use_fused_gemv_prologue).
FUSED_GEMV_PROLOGUES: frozenset[str] = _fused_gemv_prologues()

# Largest hidden size the RMSNorm prologue takes: its exact kernel holds the whole row in each
# program.
NORM_PROLOGUE_MAX_HIDDEN = 16384


def _norm_prologue_exact() -> bool:
    """SGLANG_FUSED_GEMV_NORM_EXACT: "1" / "on" / "true" / "yes" make the RMSNorm prologue round
    as the unfused kernels do (gemv_prologue.py's exact kernel); unset or "0" / "off" / "false"
    / "no": the scaled kernel. Raises ValueError naming the variable for any other value."""
    return _switch("FUSED_GEMV_NORM_EXACT", False)


# Decided once at import: which kernel the RMSNorm prologue runs (gemv_rmsnorm's `exact`).
NORM_PROLOGUE_EXACT: bool = _norm_prologue_exact()


def use_fused_gemv_prologue(x: torch.Tensor, weight: torch.Tensor, kind: str) -> bool:
    """True when the GEMV of ``x @ weight.T`` should compute x itself in its K loop
    (gemv_prologue.py; kind "norm": RMSNorm before qkv/gate_up, "silu": SiLU-and-mul before
    down): kind is in SGLANG_FUSED_GEMV_PROLOGUE, x is the GEMV input the unfused path would
    make (or a view of that shape, dtype and device), and the Triton GEMV would take it at one
    row (use_triton_gemv with max_rows 1: the prologue kernels take one row whatever
    SGLANG_TRITON_GEMV_MAX_ROWS says; SGLANG_TRITON_GEMV and SGLANG_DISABLE_TRITON_KERNELS
    apply)."""
    return kind in FUSED_GEMV_PROLOGUES and use_triton_gemv(x, weight, 1)


def _fused_gemv_epilogue_enabled() -> bool:
    """SGLANG_FUSED_GEMV_EPILOGUE: "1" / "on" / "true" / "yes" turn the gate_up GEMV's
    SiLU-and-mul epilogue on; unset or "0" / "off" / "false" / "no" leave it off. Raises
    ValueError naming the variable for any other value."""
    return _switch("FUSED_GEMV_EPILOGUE", False)


# Decided once at import (SGLANG_FUSED_GEMV_EPILOGUE): the SiLU-and-mul epilogue of the gate_up
# GEMV (gemv_epilogue.py). Off by default: on the H200 the Llama-3.1-8B-shaped batch-1 decode
# took 4.60 ms per step with it against 4.30 without (roofline fraction 0.76 against 0.82, ABAB;
# benchmark/results/decode_roofline_ep*_h200_s23.json), though it removes one kernel per layer
# and reads nothing more: with half the rows per weight block its programs keep half the bytes
# in flight. SmolLM2's graph step was 0.678 against 0.695 ms.
FUSED_GEMV_EPILOGUE_ENABLED: bool = _fused_gemv_epilogue_enabled()


def use_fused_gemv_epilogue(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when gate_up_proj's GEMV of ``x @ weight.T`` should write silu(gate) * up itself
    (gemv_epilogue.py): the epilogue is on (SGLANG_FUSED_GEMV_EPILOGUE), the SiLU-and-mul
    prologue of the down GEMV is not (SGLANG_FUSED_GEMV_PROLOGUE without "silu": that one
    wants gate_up), and the Triton GEMV would take x at one row (use_triton_gemv with
    max_rows 1). Llama's decoder layer asks only when its RMSNorm prologue did not take
    gate_up first: with the "norm" prologue (the default) gate_up runs inside rmsnorm_linear,
    so the epilogue needs SGLANG_FUSED_GEMV_PROLOGUE=0 to apply there."""
    return (
        FUSED_GEMV_EPILOGUE_ENABLED
        and "silu" not in FUSED_GEMV_PROLOGUES
        and use_triton_gemv(x, weight, 1)
    )


def _fused_rope_kv_enabled() -> bool:
    flag = env_flag("FUSED_ROPE_KV").strip().lower()
    return _triton_enabled() and flag not in _OFF


# Decided once at import: the Triton kernels are enabled and SGLANG_FUSED_ROPE_KV is not "0".
FUSED_ROPE_KV_ENABLED: bool = _fused_rope_kv_enabled()


def _fused_rope_decode_enabled() -> bool:
    """SGLANG_FUSED_ROPE_DECODE: unset or "1" / "on" / "true" / "yes" let the grouped Triton
    decode kernel do a decode step's RoPE and KV store itself (layers/fused_rope_kv.decode_rope;
    on by default since the twenty-sixth session's H200 runs: 8B batch-1 step 4.207 -> 4.198
    ms over three ABAB pairs, SmolLM2 batch-1 graph 0.630 -> 0.605 ms); "0" / "off" /
    "false" / "no" leave them to rope_kv.py's kernel. Raises ValueError naming the variable
    for any other value."""
    return _switch("FUSED_ROPE_DECODE", True) and _triton_enabled()


# Decided once at import (SGLANG_FUSED_ROPE_DECODE): RoPE and the KV store inside the grouped
# decode kernel (attention/triton_ops/decode_grouped.DecodeRope), on by default (see above).
FUSED_ROPE_DECODE_ENABLED: bool = _fused_rope_decode_enabled()


def use_fused_rope_decode(tensor: torch.Tensor) -> bool:
    """True when a decode step's RoPE and KV store may run inside the decode kernel for this
    tensor (CUDA, SGLANG_FUSED_ROPE_DECODE on); the step's own conditions are checked by
    layers/fused_rope_kv.decode_rope."""
    return FUSED_ROPE_DECODE_ENABLED and tensor.is_cuda and not needs_autograd(tensor)


def use_fused_rope_kv(tensor: torch.Tensor) -> bool:
    """True when RoPE and the KV store may run as one kernel for this tensor (CUDA, the Triton
    kernels enabled, SGLANG_FUSED_ROPE_KV not "0"); the step's own conditions are checked by
    layers/fused_rope_kv.fused_rope_kv_applies."""
    return FUSED_ROPE_KV_ENABLED and tensor.is_cuda and not needs_autograd(tensor)


def _triton_pdl_enabled() -> bool:
    """SGLANG_TRITON_PDL: unset or "1" / "on" / "true" / "yes" let the decode-step kernels
    launch with programmatic dependent launch where the GPU has it (pdl.py); "0" / "off" /
    "false" / "no" launch them as before. Raises ValueError naming the variable otherwise."""
    return _switch("TRITON_PDL", True)


# Decided once at import (SGLANG_TRITON_PDL, on by default): pdl.launch_args gives the kernels
# with a USE_PDL constexpr the programmatic-dependent-launch flag on SM90 and newer GPUs. On the
# H200 the Llama-3.1-8B-shaped batch-1 step went from 4.24-4.27 to 4.17 ms per step with it
# (roofline fraction 0.83 -> 0.845-0.848; twenty-fifth session).
TRITON_PDL_ENABLED: bool = _triton_pdl_enabled()

# SGLANG_GEMV_PREFETCH_MB unset: how many MiB of weights one GEMV launch asks L2 to prefetch
# before it waits for the kernel ahead of it (pdl.prefetch_cols). Off: on the H200 the 8B-shaped
# batch-1 step took 4.17 ms with PDL and no prefetch, 4.17 at 2 MiB, 4.48 at 8 and 4.55 at 16
# (twenty-fifth session, pdl.py's docstring).
DEFAULT_GEMV_PREFETCH_MB = 0.0


def _gemv_prefetch_bytes() -> int:
    """SGLANG_GEMV_PREFETCH_MB: MiB of its weight a GEMV launched with PDL prefetches into L2
    before its wait (0 turns the prefetch off); unset or "" means DEFAULT_GEMV_PREFETCH_MB.
    Raises ValueError naming the variable for anything but a number >= 0."""
    flag = env_flag("GEMV_PREFETCH_MB").strip()
    if flag == "":
        return int(DEFAULT_GEMV_PREFETCH_MB * 2**20)
    try:
        mib = float(flag)
    except ValueError:
        mib = -1.0
    if not mib >= 0 or mib == float("inf"):
        raise ValueError(f"SGLANG_GEMV_PREFETCH_MB={flag!r}: expected a number of MiB >= 0")
    return int(mib * 2**20)


# Decided once at import: the L2 prefetch budget of one GEMV launch, in bytes.
GEMV_PREFETCH_BYTES: int = _gemv_prefetch_bytes()
