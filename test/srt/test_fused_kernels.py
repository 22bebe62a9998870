"""Fused Triton kernels (RMSNorm + residual, SiLU-and-mul, RoPE) against the PyTorch layers.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported); the layers' PyTorch code
(their CPU path) is the reference.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers import triton_kernels  # noqa: E402
from sglang.srt.layers.activation import SiluAndMul  # noqa: E402
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope  # noqa: E402
from sglang.srt.layers.triton_kernels.activation import silu_and_mul  # noqa: E402
from sglang.srt.layers.triton_kernels.rmsnorm import rmsnorm  # noqa: E402
from sglang.srt.layers.triton_kernels.rotary import rotary_embedding_  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# One unit in the last place, relative (torch's defaults): a result of magnitude 4 in bfloat16
# may differ by one rounding step (0.03) when fp32 rsqrt/exp differ in their last bit.
RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# DEVICE: the interpreter path on CPU; with CUDA present the same tests run compiled on the GPU
# (every tensor they create lands on the default device the fixture below sets).


@pytest.fixture(autouse=True)
def _default_device(request, monkeypatch):
    """Tensors on DEVICE; outside the gpu-marked dispatch test the layers keep their PyTorch
    path (the reference) while the kernels are called directly."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(triton_kernels, "TRITON_KERNELS_ENABLED", False)
    with torch.device(DEVICE):
        yield


def _ref_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    """The PyTorch path of RMSNorm.forward, whatever the device (dispatch bypassed)."""
    if residual is None:
        return norm._norm(x)
    r = x + residual
    return norm._norm(r), r


def _make_norm(hidden: int, dtype: torch.dtype, device: str) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    return norm.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (7, 576), (3, 100)])
def test_rmsnorm_matches_torch(dtype: torch.dtype, num_tokens: int, hidden: int) -> None:
    torch.manual_seed(0)
    norm = _make_norm(hidden, dtype, DEVICE)
    x = (torch.randn(num_tokens, hidden) * 3).to(dtype)
    residual = torch.randn(num_tokens, hidden).to(dtype)
    x_before, res_before = x.clone(), residual.clone()

    out = rmsnorm(x, norm.weight, norm.variance_epsilon)
    ref = _ref_norm(norm, x, None)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=RTOL[dtype])

    out, new_res = rmsnorm(x, norm.weight, norm.variance_epsilon, residual)
    ref_out, ref_res = _ref_norm(norm, x, residual)
    # The residual sum is one rounded add in both paths: equal exactly.
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=RTOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs untouched


def test_rmsnorm_strided_rows_and_3d() -> None:
    torch.manual_seed(1)
    norm = _make_norm(576, torch.float32, DEVICE)
    wide = torch.randn(4, 1000)
    x = wide[:, 10:586]  # [4, 576] rows with stride 1000
    ref = _ref_norm(norm, x, None)
    torch.testing.assert_close(rmsnorm(x, norm.weight, 1e-5), ref, atol=1e-5, rtol=0)
    x3 = torch.randn(2, 3, 576)
    out3 = rmsnorm(x3, norm.weight, 1e-5)
    assert out3.shape == (2, 3, 576)
    torch.testing.assert_close(out3, _ref_norm(norm, x3, None), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        rmsnorm(x3, norm.weight[:100], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(1, 1536), (5, 1536), (3, 37)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    torch.manual_seed(2)
    x = (torch.randn(num_tokens, 2 * inter) * 4).to(dtype)
    out = silu_and_mul(x)
    ref = SiluAndMul()(x)  # the PyTorch path (dispatch off)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=RTOL[dtype])
    with pytest.raises(ValueError):
        silu_and_mul(x[:, :-1])


def _qkv(num_tokens: int, hq: int, hk: int, head: int, dtype: torch.dtype, device: str):
    """q, k as strided views of one fused qkv tensor, as LlamaAttention makes them."""
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head, device=device).to(dtype)
    return qkv, qkv.split([hq * head, hk * head, hk * head], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,hq,hk,head,rotary_dim",
    [(1, 9, 3, 64, 64), (6, 9, 3, 64, 64), (4, 4, 2, 48, 32)],  # SmolLM2 heads; partial rotary
)
def test_rotary_in_place_matches_torch(
    dtype: torch.dtype, num_tokens: int, hq: int, hk: int, head: int, rotary_dim: int
) -> None:
    torch.manual_seed(3)
    rope = RotaryEmbedding(head, rotary_dim, 2048, 10000.0)
    positions = torch.randint(0, 2048, (num_tokens,), dtype=torch.int64)
    qkv, (q, k, v) = _qkv(num_tokens, hq, hk, head, dtype, DEVICE)
    v_before = v.clone()
    ref_q, ref_k = rope(positions, q.clone(), k.clone())  # the PyTorch path (dispatch off)
    out_q, out_k = rotary_embedding_(positions, q, k, rope.cos_sin_cache, head, rotary_dim)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, ref_q, atol=ATOL[dtype], rtol=RTOL[dtype])
    torch.testing.assert_close(k, ref_k, atol=ATOL[dtype], rtol=RTOL[dtype])
    assert torch.equal(v, v_before)  # the value part of qkv is untouched


def test_rotary_llama3_cache_int32_positions_and_3d() -> None:
    torch.manual_seed(4)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    rope = get_rope(64, 64, 4096, 500000.0, scaling)
    positions = torch.tensor([0, 1, 700, 4095], dtype=torch.int32)
    q = torch.randn(4, 2, 64)
    k = torch.randn(4, 1, 64)
    ref_q, ref_k = rope(positions.long(), q.clone(), k.clone())
    rotary_embedding_(positions, q, k, rope.cos_sin_cache, 64, 64)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=0)


def test_dispatch_off_on_cpu(monkeypatch) -> None:
    monkeypatch.setattr(triton_kernels, "TRITON_KERNELS_ENABLED", True)
    x = torch.randn(2, 8, device="cpu")
    assert not triton_kernels.use_triton_kernels(x)  # CPU tensors keep the PyTorch path


def _cuda_skip():
    return pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.mark.gpu
@_cuda_skip()
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
def test_layers_dispatch_on_cuda_bf16(num_tokens: int) -> None:
    """On CUDA the layers run the Triton kernels; compare against their PyTorch code."""
    assert triton_kernels.TRITON_KERNELS_ENABLED
    torch.manual_seed(5)
    dtype, dev = torch.bfloat16, "cuda"
    norm = _make_norm(576, dtype, dev)
    x = torch.randn(num_tokens, 576, device=dev).to(dtype)
    res = torch.randn(num_tokens, 576, device=dev).to(dtype)
    out, new_res = norm(x, res)
    ref_out, ref_res = _ref_norm(norm, x, res)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(norm(x), _ref_norm(norm, x, None), atol=1e-2, rtol=1.6e-2)

    gate_up = (torch.randn(num_tokens, 2 * 1536, device=dev) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ref_act = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(SiluAndMul()(gate_up), ref_act, atol=1e-2, rtol=1.6e-2)

    rope = RotaryEmbedding(64, 64, 2048, 10000.0).to(dev)
    positions = torch.randint(0, 2048, (num_tokens,), device=dev)
    _, (q, k, _v) = _qkv(num_tokens, 9, 3, 64, dtype, dev)
    with torch.device("cpu"):  # the autouse fixture makes CUDA the default device
        cpu_rope = RotaryEmbedding(64, 64, 2048, 10000.0)
    ref_q, ref_k = cpu_rope(positions.cpu(), q.cpu(), k.cpu())  # PyTorch path on CPU
    out_q, out_k = rope(positions, q, k)
    torch.testing.assert_close(out_q.cpu(), ref_q, atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out_k.cpu(), ref_k, atol=1e-2, rtol=1.6e-2)
