"""Where the Triton kernel tests run: compiled on CUDA, else on CPU tensors through Triton's
interpreter.

Importing this module sets TRITON_INTERPRET=1 when CUDA is absent. It must run before triton is
first imported (``triton.jit`` reads the variable when a kernel is decorated), so
test/srt/conftest.py imports it before pytest collects any test module; the kernel tests import
HAS_CUDA and DEVICE from here (first, so a file run with --noconftest is set up too).

The interpreter cannot check bfloat16 attention: our extend kernel's bf16 ``tl.dot`` gave
outputs off by 1e8 there (float16 and float32 agree with the reference within 6e-4 and 5e-7;
the compiled bf16 kernels are checked on a GPU by test_triton_attention.py
test_cuda_bf16_matches_reference). CPU tests of Triton kernels use float32 or float16.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA: bool = torch.cuda.is_available()
# Tensors of the kernel tests: compiled kernels on the GPU, or the interpreter on CPU tensors.
DEVICE: str = "cuda" if HAS_CUDA else "cpu"

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def compiled_variants(*kernels) -> list[int]:
    """How many variants of each @triton.jit kernel this process has compiled on the current
    CUDA device (Triton's per-device kernel cache). Tests of the "one variant" rule
    (layers/triton_kernels/__init__.py, "Variants") compare it before and after calls with
    changing shapes. Calls pytest.skip where this Triton keeps no such cache."""
    import pytest

    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps no per-device kernel cache to inspect")
    dev = torch.cuda.current_device()
    return [len(k.device_caches[dev][0]) for k in kernels]
