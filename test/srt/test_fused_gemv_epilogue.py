"""The gate_up GEMV with SiLU-and-mul in its epilogue (layers/triton_kernels/gemv_epilogue.py):
against the GEMV then the SiLU-and-mul kernel (bit for bit under the interpreter at the same
BLOCK_K) and a float64 reference, its switch, and its use in LlamaMLP (at one row on CUDA).

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported), so the shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers import fused_linear, triton_kernels  # noqa: E402
from sglang.srt.layers.triton_kernels import gemv_epilogue  # noqa: E402
from sglang.srt.layers.triton_kernels.activation import silu_and_mul  # noqa: E402
from sglang.srt.layers.triton_kernels.gemv import GemvTile, gemv, pick_tile  # noqa: E402
from sglang.srt.layers.triton_kernels.gemv_epilogue import epilogue_tile, gemv_silu_mul  # noqa: E402
from sglang.test.fused_gemv_checks import (  # noqa: E402
    prefill_then_decode,
    route_layers_through_triton,
    seeded_randn,
    tiny_bf16_model,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Against the float64 reference: gate and up rounded, silu rounded, the product rounded.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _default_device(monkeypatch):
    """Tensors on DEVICE; the layers' dispatch off unless a test turns it on."""
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", False)
    with torch.device(DEVICE):
        yield


def _operands(inter: int, k: int, dtype: torch.dtype, seed: int = 0):
    """x [1, k]; weight [2 * inter, k] with O(1) outputs; bias [2 * inter]."""
    x = (seeded_randn(1, k, seed=seed) * 2).to(dtype)
    w = seeded_randn(2 * inter, k, seed=seed + 1, scale=k**-0.5).to(dtype)
    b = seeded_randn(2 * inter, seed=seed + 2).to(dtype)
    return x, w, b


def _exact_or_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit under the interpreter. Compiled, a [BLOCK_N, BLOCK_K] sum may reduce in
    another order for another BLOCK_N (the epilogue's is half the GEMV's): one rounding apart."""
    if HAS_CUDA:
        torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=RTOL[dtype])
    else:
        assert torch.equal(out, ref)


# ------------------------------------------------------------------------------- kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "inter,k,tile", [(37, 300, None), (37, 300, GemvTile(4, 64, 2)), (24, 1000, None)]
)
def test_gemv_silu_mul_equals_unfused(dtype, with_bias, inter, k, tile) -> None:
    """Against gemv then silu_and_mul at the same BLOCK_K: exact under the interpreter; against
    float64: within rounding. inter is not a multiple of BLOCK_N, k not one of BLOCK_K (k =
    1000 takes two K steps of the default 512; the small tile, several with a partial one)."""
    x, w, b = _operands(inter, k, dtype)
    b = b if with_bias else None
    y = gemv_silu_mul(x, w, b, tile=tile)
    assert y.shape == (1, inter) and y.dtype == dtype and y.is_contiguous()
    unfused_tile = None if tile is None else GemvTile(2 * tile.block_n, tile.block_k, 2)
    if tile is None:
        assert epilogue_tile(2 * inter, k).block_k == pick_tile(2 * inter, k).block_k
    _exact_or_close(y, silu_and_mul(gemv(x, w, b, tile=unfused_tile)), dtype)
    gu = F.linear(x.double(), w.double(), None if b is None else b.double())
    g, u = gu.chunk(2, dim=-1)
    ref = F.silu(g) * u
    torch.testing.assert_close(y, ref.to(dtype), atol=ATOL[dtype], rtol=RTOL[dtype])


def test_epilogue_tile_halves_block_n_only() -> None:
    """Each program loads BLOCK_N gate and BLOCK_N up rows: the unfused GEMV's tile with half
    its BLOCK_N (at least 1) and the same BLOCK_K and warps; e.g. the Llama-3.1-8B gate_up
    [28672, 4096] and SmolLM2's [3072, 576]."""
    for n, k in ((28672, 4096), (3072, 576), (2, 64)):
        full, half = pick_tile(n, k), epilogue_tile(n, k)
        assert (half.block_k, half.num_warps) == (full.block_k, full.num_warps)
        assert half.block_n == max(1, full.block_n // 2)


def test_rejects_unsupported_inputs() -> None:
    x, w, b = _operands(16, 32, torch.bfloat16)
    bad = {
        "two rows": dict(x=torch.cat([x, x])),
        "1-D x": dict(x=x[0]),
        "odd weight rows": dict(w=w[:31].contiguous()),
        "K mismatch": dict(w=w[:, :31].contiguous()),
        "dtype mismatch": dict(w=w.float()),
        "non-contiguous weight": dict(w=w.t().contiguous().t()),
        "x strided along K": dict(x=torch.randn(1, 64, dtype=torch.bfloat16)[:, ::2]),
        "bias shape": dict(b=b[:15]),
        "bias dtype": dict(b=b.float()),
    }
    for what, change in bad.items():
        kw = dict(x=x, w=w, b=b) | change
        with pytest.raises(ValueError, match="gemv_silu_mul"):
            gemv_silu_mul(kw["x"], kw["w"], kw["b"])
            pytest.fail(what)


# ------------------------------------------------------------------------------- dispatch


def test_flag_is_read_from_the_environment(monkeypatch) -> None:
    read = triton_kernels._fused_gemv_epilogue_enabled
    monkeypatch.delenv("SGLANG_FUSED_GEMV_EPILOGUE", raising=False)
    assert not read()  # off by default (slower on the H200, triton_kernels/__init__.py)
    for value, on in (("0", False), (" Off ", False), ("false", False), ("1", True), ("On ", True)):
        monkeypatch.setenv("SGLANG_FUSED_GEMV_EPILOGUE", value)
        assert read() == on, value
    for bad in ("2", "silu", "maybe"):
        monkeypatch.setenv("SGLANG_FUSED_GEMV_EPILOGUE", bad)
        with pytest.raises(ValueError, match="SGLANG_FUSED_GEMV_EPILOGUE"):
            read()


def test_gate_needs_the_switch_the_gemv_and_no_silu_prologue(monkeypatch) -> None:
    """use_fused_gemv_epilogue = the switch is on, the down GEMV's SiLU prologue is off (it
    takes gate_up) and use_triton_gemv at one row (so SGLANG_TRITON_GEMV=0 turns it off too)."""
    x, w = torch.randn(1, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    seen = []
    monkeypatch.setattr(triton_kernels, "use_triton_gemv", lambda *a: seen.append(a[2]) or True)
    for enabled, prologues, want in (
        (True, (), True),
        (True, ("norm",), True),
        (True, ("silu",), False),
        (False, (), False),
    ):
        monkeypatch.setattr(triton_kernels, "FUSED_GEMV_EPILOGUE_ENABLED", enabled)
        monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", frozenset(prologues))
        assert triton_kernels.use_fused_gemv_epilogue(x, w) == want
    assert seen == [1, 1]  # asked for one row, and only when the switches allow
    monkeypatch.undo()
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", True)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_EPILOGUE_ENABLED", True)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", frozenset())
    if HAS_CUDA:
        assert triton_kernels.use_fused_gemv_epilogue(x.cuda(), w.cuda())
    assert not triton_kernels.use_fused_gemv_epilogue(x.cpu(), w.cpu())
    two_rows = torch.randn(2, 32, dtype=torch.bfloat16, device=DEVICE)
    assert not triton_kernels.use_fused_gemv_epilogue(two_rows, w.to(DEVICE))


def _cpu_gate(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """use_fused_gemv_epilogue without its CUDA condition (the kernel runs interpreted)."""
    return (
        triton_kernels.FUSED_GEMV_EPILOGUE_ENABLED
        and "silu" not in triton_kernels.FUSED_GEMV_PROLOGUES
        and triton_kernels.TRITON_GEMV_ENABLED
        and triton_kernels.gemv_applies(x, weight, 1)
    )


@pytest.fixture
def triton_on_cpu(monkeypatch) -> list[int]:
    """Every Triton path of a decoder layer on CPU tensors (the rotary embedding excepted): the
    RMSNorm and SiLU kernels, the GEMV, and the epilogue GEMV, whose calls are counted."""
    calls = [0]
    real = gemv_epilogue.gemv_silu_mul

    def spy(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(gemv_epilogue, "gemv_silu_mul", spy)
    route_layers_through_triton(monkeypatch)
    monkeypatch.setattr(fused_linear, "use_fused_gemv_epilogue", _cpu_gate)
    # the RMSNorm prologue (on by default) would take gate_up before the epilogue could
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", frozenset())
    return calls


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """(model, ModelConfig): fused_gemv_checks.tiny_bf16_model, a tiny Llama."""
    return tiny_bf16_model(str(tmp_path_factory.mktemp("llama")))


def test_decode_equal_with_and_without_epilogue(monkeypatch, triton_on_cpu, tiny_bf16) -> None:
    """Logits and EAGLE-3 aux states of the tiny model (bf16) equal bit for bit with the
    epilogue on and off (the unfused path: the GEMV then the SiLU-and-mul kernel); one epilogue
    GEMV per layer per decode step, none for the prefill's 5 rows."""
    model, mc = tiny_bf16
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_EPILOGUE_ENABLED", False)
    unfused = prefill_then_decode(model, mc)
    assert triton_on_cpu == [0]
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_EPILOGUE_ENABLED", True)
    fused = prefill_then_decode(model, mc)
    assert triton_on_cpu == [mc.num_hidden_layers * 2]
    for a, b in zip(fused, unfused, strict=True):
        _exact_or_close(a, b, torch.bfloat16)
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", False)  # the GEMV gate: off too
    torch_path = prefill_then_decode(model, mc)
    assert triton_on_cpu == [mc.num_hidden_layers * 2]
    for a, b in zip(fused, torch_path, strict=True):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


def test_applies_only_to_gate_up(monkeypatch, triton_on_cpu, tiny_bf16) -> None:
    """gate_up_proj at one row of its dtype; not two rows, another dtype, a layer of three
    sub-projections (qkv_proj), a row-parallel layer, skip_bias_add, or with the switch off."""
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_EPILOGUE_ENABLED", True)
    layer = tiny_bf16[0].model.layers[0]
    gate_up, qkv, down = layer.mlp.gate_up_proj, layer.self_attn.qkv_proj, layer.mlp.down_proj
    applies = fused_linear.linear_silu_mul_applies
    x = torch.randn(1, gate_up.input_size, dtype=torch.bfloat16)
    assert applies(x, gate_up)
    assert not applies(torch.cat([x, x]), gate_up)
    assert not applies(x.float(), gate_up)
    assert not applies(x, qkv)
    assert not applies(torch.randn(1, down.input_size, dtype=torch.bfloat16), down)
    monkeypatch.setattr(gate_up, "skip_bias_add", True)
    assert not applies(x, gate_up)
    monkeypatch.setattr(gate_up, "skip_bias_add", False)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_EPILOGUE_ENABLED", False)
    assert not applies(x, gate_up)
