"""Where the Triton kernel tests run: compiled on CUDA, else on CPU tensors through Triton's
interpreter.

Importing this module sets TRITON_INTERPRET=1 when CUDA is absent. It must run before triton is
first imported (``triton.jit`` reads the variable when a kernel is decorated), so
test/srt/conftest.py imports it before pytest collects any test module; the kernel tests import
HAS_CUDA and DEVICE from here (first, so a file run with --noconftest is set up too).
"""

from __future__ import annotations

import os

import torch

HAS_CUDA: bool = torch.cuda.is_available()
# Tensors of the kernel tests: compiled kernels on the GPU, or the interpreter on CPU tensors.
DEVICE: str = "cuda" if HAS_CUDA else "cpu"

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
