"""Shared set-up of the fused GEMV tests (test_fused_gemv_prologue.py, test_fused_gemv_epilogue.py):
seeded operands, a decoder layer's Triton paths routed onto CPU tensors (Triton's interpreter)
and a tiny bf16 model run through one prefill and two batch-1 decode steps.

Import sglang.test.triton_interpreter before this module (it must set TRITON_INTERPRET before
triton is imported; the test files import it first).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers import activation, layernorm, linear, triton_kernels
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.model_loader.loader import get_model
from sglang.test.forward_harness import ForwardHarness
from sglang.test.tiny_models import make_tiny_model_dir
from sglang.test.triton_interpreter import DEVICE


def seeded_randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[*shape] float32 standard normal times scale on DEVICE, drawn from a CPU generator
    seeded with `seed` (the same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cpu").to(DEVICE) * scale


def route_layers_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send a decoder layer's RMSNorm, SiLU-and-mul and linear layers to the Triton kernels on
    any device (their CUDA condition dropped; the rotary embedding stays in torch), the GEMV
    at one row: more rows would run the interpreter's bf16 tl.dot, which is wrong. The fused
    GEMVs keep their own gates (the callers patch those)."""
    monkeypatch.setattr(layernorm, "use_triton_kernels", lambda t, *more: True)
    monkeypatch.setattr(activation, "use_triton_kernels", lambda t, *more: True)
    monkeypatch.setattr(
        linear,
        "use_triton_gemv",
        lambda x, w: triton_kernels.TRITON_GEMV_ENABLED and triton_kernels.gemv_applies(x, w),
    )
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", True)
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_MAX_ROWS", 1)


def tiny_bf16_model(folder: str, arch: str = "LlamaForCausalLM"):
    """(model on DEVICE, ModelConfig): a 2-layer tiny `arch` in bfloat16 written to `folder`,
    EAGLE-3 capture on (inputs of layers 0, 1 and the last layer's output). Weights of std
    0.05, not the tiny models' default 0.5, which makes each layer amplify: the tolerances of
    the compiled kernels (one rounding step apart here and there) must hold at the logits."""
    with torch.device("cpu"):
        path = make_tiny_model_dir(folder, arch=arch, weight_std=0.05)
        mc = ModelConfig(path, dtype="bfloat16")
        model = get_model(mc, device=DEVICE)
    model.set_eagle3_layers_to_capture([-1, 0, 1])
    return model, mc


def prefill_then_decode(model, mc: ModelConfig) -> list[torch.Tensor]:
    """A 5-token prefill (5 rows: never fused) then two batch-1 decode steps of one request;
    per forward its logits [rows, V] and captured aux states [T, 3H]."""
    harness = ForwardHarness(model, mc, device=DEVICE)
    req = harness.new_request()
    outs = []
    for ids in ([1, 2, 3, 4, 5], [6], [7]):
        out = harness.forward([(req, ids)], capture_hidden_mode=CaptureHiddenMode.FULL)
        outs += [out.next_token_logits, out.hidden_states]
    return outs
