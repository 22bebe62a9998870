"""The GEMV with its input computed in its K loop (layers/triton_kernels/gemv_prologue.py):
RMSNorm -> GEMV and SiLU-and-mul -> GEMV against the unfused Triton kernels (bit for bit under
the interpreter) and a float64 reference, and their use in the Llama decoder layer (at one row on
CUDA; SGLANG_FUSED_GEMV_PROLOGUE: the RMSNorm one by default).

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported), so the shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers import fused_linear, triton_kernels  # noqa: E402
from sglang.srt.layers.triton_kernels import gemv_prologue  # noqa: E402
from sglang.srt.layers.triton_kernels.activation import silu_and_mul  # noqa: E402
from sglang.srt.layers.triton_kernels.gemv import GemvTile, gemv  # noqa: E402
from sglang.srt.layers.triton_kernels.gemv_prologue import (  # noqa: E402
    gemv_rmsnorm,
    gemv_silu_mul,
)
from sglang.srt.layers.triton_kernels.rmsnorm import rmsnorm  # noqa: E402
from sglang.srt.model_loader.loader import get_model  # noqa: E402
from sglang.srt.speculative.draft_config import load_draft_model  # noqa: E402
from sglang.test.forward_harness import ForwardHarness  # noqa: E402
from sglang.test.fused_gemv_checks import (  # noqa: E402
    prefill_then_decode,
    route_layers_through_triton,
    seeded_randn,
    tiny_bf16_model,
)
from sglang.test.tiny_eagle import make_tiny_eagle_dir  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Against the float64 reference: one rounding of the output plus the rounded intermediates.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SMALL_TILE = GemvTile(4, 64, 2)  # several K steps and a partial last one at these sizes
EPS = 1e-5
NONE, ALL = frozenset(), frozenset(triton_kernels.GEMV_PROLOGUE_KINDS)


def _exact_or_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit under the interpreter. Compiled, the sum of squares of the norm may reduce in
    another order than rmsnorm.py's (gemv_prologue.py's docstring): one rounding step apart."""
    if HAS_CUDA:
        torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=RTOL[dtype])
    else:
        assert torch.equal(out, ref)


@pytest.fixture(autouse=True)
def _default_device(monkeypatch):
    """Tensors on DEVICE; the layers' dispatch off unless a test turns it on."""
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", False)
    with torch.device(DEVICE):
        yield


def _norm_operands(n: int, h: int, dtype: torch.dtype, seed: int = 0):
    """x, residual [1, h]; norm weight [h] around 1; weight [n, h] with O(1) outputs; bias [n]."""
    x = (seeded_randn(1, h, seed=seed) * 3).to(dtype)
    res = seeded_randn(1, h, seed=seed + 1).to(dtype)
    nw = (1 + seeded_randn(h, seed=seed + 2, scale=0.2)).to(dtype)
    w = seeded_randn(n, h, seed=seed + 3, scale=h**-0.5).to(dtype)
    b = seeded_randn(n, seed=seed + 4).to(dtype)
    return x, res, nw, w, b


def _ref_norm_linear(x, res, nw, w, b) -> torch.Tensor:
    """float64 RMSNorm then linear, no intermediate rounding."""
    h = x.double() if res is None else x.double() + res.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
    return F.linear(normed, w.double(), None if b is None else b.double()).to(x.dtype)


# ------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,h,tile", [(37, 300, None), (37, 300, SMALL_TILE), (24, 1000, None)])
@pytest.mark.parametrize("exact", [True, False])
def test_gemv_rmsnorm_equals_unfused(dtype, with_residual, with_bias, n, h, tile, exact) -> None:
    """Against rmsnorm then gemv (same tile): the exact kernel bit for bit, the scaled one
    (1/rms applied after the K loop, the normed row never rounded) within one rounding of the
    output; both against float64 within rounding. H and N are not multiples of the tiles;
    h = 1000 takes two K steps of the default 512."""
    x, res, nw, w, b = _norm_operands(n, h, dtype)
    res = res if with_residual else None
    b = b if with_bias else None
    x_before = x.clone()
    y, res_out = gemv_rmsnorm(x, nw, EPS, w, b, res, tile=tile, exact=exact)
    assert y.shape == (1, n) and y.dtype == dtype and y.is_contiguous()

    if res is None:
        normed, unfused_res = rmsnorm(x, nw, EPS), None
        assert res_out is None
    else:
        normed, unfused_res = rmsnorm(x, nw, EPS, res)
        assert torch.equal(res_out, x + res)  # one rounded add, as torch rounds it
        assert torch.equal(res_out, unfused_res)
    unfused = gemv(normed, w, b, tile=tile)
    if exact:
        _exact_or_close(y, unfused, dtype)
    else:
        torch.testing.assert_close(y, unfused, atol=ATOL[dtype], rtol=RTOL[dtype])
    ref = _ref_norm_linear(x, res, nw, w, b)
    torch.testing.assert_close(y, ref, atol=ATOL[dtype], rtol=RTOL[dtype])
    if not exact and dtype != torch.float32:
        # The scaled kernel skips the unfused path's two roundings of each normed element:
        # over the row it is no further from float64 than the unfused result (plus one
        # rounding step of the output for ties broken the other way).
        step = torch.finfo(dtype).eps * ref.double().abs().max().item()
        err = (y.double() - ref.double()).abs().mean().item()
        assert err <= (unfused.double() - ref.double()).abs().mean().item() + step
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter,tile", [(37, 300, None), (37, 300, SMALL_TILE), (8, 600, None)])
def test_gemv_silu_mul_equals_unfused(dtype, n, inter, tile) -> None:
    gate_up = (seeded_randn(1, 2 * inter, seed=5) * 3).to(dtype)
    w = seeded_randn(n, inter, seed=6, scale=inter**-0.5).to(dtype)
    y = gemv_silu_mul(gate_up, w, tile=tile)
    assert y.shape == (1, n) and y.dtype == dtype
    assert torch.equal(y, gemv(silu_and_mul(gate_up), w, tile=tile))  # elementwise: exact
    g, u = gate_up.double().chunk(2, dim=-1)
    ref = F.linear(F.silu(g) * u, w.double()).to(dtype)
    torch.testing.assert_close(y, ref, atol=ATOL[dtype], rtol=RTOL[dtype])


def test_prologue_kernels_reject_unsupported_inputs() -> None:
    x, res, nw, w, b = _norm_operands(16, 32, torch.bfloat16)
    bad_norm = {
        "two rows": dict(x=torch.cat([x, x])),
        "1-D x": dict(x=x[0]),
        "dtype mismatch": dict(w=w.float()),
        "K mismatch": dict(w=w[:, :31].contiguous()),
        "non-contiguous weight": dict(w=w.t().contiguous().t()),
        "norm weight shape": dict(nw=nw[:31]),
        "norm weight dtype": dict(nw=nw.float()),
        "residual dtype": dict(res=res.half()),
        "bias shape": dict(b=b[:15]),
        "x strided along K": dict(x=torch.randn(1, 64, dtype=torch.bfloat16)[:, ::2]),
        "too wide": dict(x=torch.zeros(1, 16385, dtype=torch.bfloat16)),
    }
    for what, change in bad_norm.items():
        kw = dict(x=x, nw=nw, w=w, b=b, res=res) | change
        with pytest.raises(ValueError, match="gemv_rmsnorm"):
            gemv_rmsnorm(kw["x"], kw["nw"], EPS, kw["w"], kw["b"], kw["res"])
            pytest.fail(what)
    gate_up = torch.randn(1, 64, dtype=torch.bfloat16)
    for what, (gu, ww) in {
        "odd width": (gate_up[:, :63], w),
        "K mismatch": (gate_up, w[:, :16].contiguous()),
        "strided": (torch.randn(1, 128, dtype=torch.bfloat16)[:, ::2], w),
        "dtype mismatch": (gate_up, w.half()),
    }.items():
        with pytest.raises(ValueError, match="gemv_silu_mul"):
            gemv_silu_mul(gu, ww)
            pytest.fail(what)


# ------------------------------------------------------------------------------- dispatch


def test_flag_is_read_from_the_environment(monkeypatch) -> None:
    read = triton_kernels._fused_gemv_prologues
    monkeypatch.delenv("SGLANG_FUSED_GEMV_PROLOGUE", raising=False)
    assert read() == {"norm"}  # the RMSNorm prologue by default
    for value, kinds in (
        ("", {"norm"}),
        ("0", set()),
        ("off", set()),
        ("1", {"norm", "silu"}),
        ("all", {"norm", "silu"}),
        ("norm", {"norm"}),
        (" SiLU ", {"silu"}),
        ("silu,norm", {"norm", "silu"}),
    ):
        monkeypatch.setenv("SGLANG_FUSED_GEMV_PROLOGUE", value)
        assert read() == kinds, value
    for bad in ("rope", "norm,gelu", ","):
        monkeypatch.setenv("SGLANG_FUSED_GEMV_PROLOGUE", bad)
        with pytest.raises(ValueError, match="SGLANG_FUSED_GEMV_PROLOGUE"):
            read()


def test_norm_exact_flag_is_read_from_the_environment(monkeypatch) -> None:
    read = triton_kernels._norm_prologue_exact
    monkeypatch.delenv("SGLANG_FUSED_GEMV_NORM_EXACT", raising=False)
    assert read() is False  # the scaled kernel by default
    for value, exact in (("1", True), ("on", True), (" TRUE ", True), ("0", False), ("no", False)):
        monkeypatch.setenv("SGLANG_FUSED_GEMV_NORM_EXACT", value)
        assert read() is exact, value
    monkeypatch.setenv("SGLANG_FUSED_GEMV_NORM_EXACT", "exact")
    with pytest.raises(ValueError, match="SGLANG_FUSED_GEMV_NORM_EXACT"):
        read()


def test_gate_needs_the_gemv_gate_and_the_kind(monkeypatch) -> None:
    """use_fused_gemv_prologue = the kind is on and use_triton_gemv (so SGLANG_TRITON_GEMV=0 and
    SGLANG_DISABLE_TRITON_KERNELS=1 turn the fusion off too); never on CPU tensors."""
    x, w = torch.randn(1, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    seen = []
    monkeypatch.setattr(triton_kernels, "use_triton_gemv", lambda *a: seen.append(a) or True)
    for kinds in ((), ("silu",), ("norm", "silu")):
        monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", frozenset(kinds))
        assert triton_kernels.use_fused_gemv_prologue(x, w, "norm") == ("norm" in kinds)
        assert triton_kernels.use_fused_gemv_prologue(x, w, "silu") == ("silu" in kinds)
    assert len(seen) == 3
    monkeypatch.undo()
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", True)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", ALL)
    if HAS_CUDA:
        assert triton_kernels.use_fused_gemv_prologue(x.cuda(), w.cuda(), "norm")
    assert not triton_kernels.use_fused_gemv_prologue(x.cpu(), w.cpu(), "norm")


def test_prologue_stays_at_one_row(monkeypatch) -> None:
    """The prologue kernels take one row: use_fused_gemv_prologue asks use_triton_gemv for at
    most one row even where SGLANG_TRITON_GEMV_MAX_ROWS lets the plain GEMV take more."""
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    seen = []

    def gate(x, weight, max_rows=None):
        seen.append(max_rows)
        return triton_kernels.gemv_applies(x, weight, max_rows)

    monkeypatch.setattr(triton_kernels, "use_triton_gemv", gate)
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_MAX_ROWS", 8)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", ALL)
    for rows in (1, 2, 8):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        assert triton_kernels.gemv_applies(x, w)  # the plain GEMV would take it
        for kind in ("norm", "silu"):
            assert triton_kernels.use_fused_gemv_prologue(x, w, kind) == (rows == 1)
    assert seen == [1] * 6


def _cpu_gate(x: torch.Tensor, weight: torch.Tensor, kind: str) -> bool:
    """use_fused_gemv_prologue without its CUDA condition (the kernels run interpreted)."""
    return (
        kind in triton_kernels.FUSED_GEMV_PROLOGUES
        and triton_kernels.TRITON_GEMV_ENABLED
        and triton_kernels.gemv_applies(x, weight, 1)
    )


@pytest.fixture
def triton_on_cpu(monkeypatch) -> dict[str, int]:
    """Every Triton path of a decoder layer on CPU tensors (the rotary embedding excepted): the
    RMSNorm and SiLU kernels, the GEMV and the fused GEMVs, whose calls are counted."""
    calls = {"gemv_rmsnorm": 0, "gemv_silu_mul": 0}
    for name in calls:
        real = getattr(gemv_prologue, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(gemv_prologue, name, spy)
    route_layers_through_triton(monkeypatch)
    monkeypatch.setattr(fused_linear, "use_fused_gemv_prologue", _cpu_gate)
    return calls


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """get(arch) -> (model, ModelConfig): fused_gemv_checks.tiny_bf16_model (Qwen2 has a qkv
    bias). Compiled on a GPU the fused norm may round one bf16 step apart from the unfused
    kernel (_exact_or_close), and the tolerances must hold at the logits."""
    built: dict[str, tuple] = {}

    def get(arch: str = "LlamaForCausalLM"):
        if arch not in built:
            built[arch] = tiny_bf16_model(str(tmp_path_factory.mktemp(arch)), arch)
        return built[arch]

    return get


def _counts(calls: dict[str, int]) -> tuple[int, int]:
    return calls["gemv_rmsnorm"], calls["gemv_silu_mul"]


@pytest.mark.parametrize(
    "arch,kinds,exact",
    [
        ("LlamaForCausalLM", ("norm", "silu"), True),
        ("LlamaForCausalLM", (), True),
        ("LlamaForCausalLM", ("norm",), True),
        ("LlamaForCausalLM", ("silu",), True),
        ("Qwen2ForCausalLM", ("norm", "silu"), True),
        ("LlamaForCausalLM", ("norm", "silu"), False),
        ("Qwen2ForCausalLM", ("norm",), False),
    ],
)
def test_decode_equal_with_and_without_fusion(
    monkeypatch, triton_on_cpu, tiny_bf16, arch, kinds, exact
) -> None:
    """Logits and EAGLE-3 aux states of the tiny model (bf16) with the fusion on and off (the
    unfused path: the RMSNorm and SiLU kernels and the GEMV): equal bit for bit with the exact
    norm kernel (SGLANG_FUSED_GEMV_NORM_EXACT=1), within bf16 rounding with the scaled one (the
    default); the kinds turned on decide which fused GEMVs run: two norms and one SiLU per
    layer per decode step."""
    model, mc = tiny_bf16(arch)
    monkeypatch.setattr(triton_kernels, "NORM_PROLOGUE_EXACT", exact)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", NONE)
    unfused = prefill_then_decode(model, mc)
    assert _counts(triton_on_cpu) == (0, 0)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", frozenset(kinds))
    fused = prefill_then_decode(model, mc)
    steps, layers = 2, mc.num_hidden_layers
    assert _counts(triton_on_cpu) == (
        2 * layers * steps if "norm" in kinds else 0,
        layers * steps if "silu" in kinds else 0,
    )
    assert fused[3].shape == (1, 3 * mc.hidden_size)  # a decode step's aux states
    for a, b in zip(fused, unfused, strict=True):
        if exact or "norm" not in kinds:
            _exact_or_close(a, b, torch.bfloat16)
        else:
            torch.testing.assert_close(a, b, atol=ATOL[torch.bfloat16], rtol=RTOL[torch.bfloat16])
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", False)  # the GEMV gate: off too
    triton_on_cpu.update(gemv_rmsnorm=0, gemv_silu_mul=0)
    torch_path = prefill_then_decode(model, mc)
    assert _counts(triton_on_cpu) == (0, 0)
    for a, b in zip(fused, torch_path, strict=True):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


def test_eagle_draft_layer_without_input_norm(
    monkeypatch, triton_on_cpu, tiny_model_dir, tmp_path
) -> None:
    """An EAGLE (v1) draft of two layers reuses LlamaDecoderLayer; layer 0 has no input norm
    (nn.Identity), so only its post-attention norm fuses. Steps equal with the fusion off."""
    with torch.device("cpu"):
        mc = ModelConfig(tiny_model_dir, dtype="bfloat16")
        target = get_model(mc, device=DEVICE)
        d = make_tiny_eagle_dir(str(tmp_path / "eagle"), tiny_model_dir, seed=1, num_layers=2)
    draft = load_draft_model(d, target, mc, algorithm="EAGLE").to(DEVICE)

    def run() -> list[torch.Tensor]:
        harness = ForwardHarness(draft, ModelConfig(d, dtype="bfloat16"), device=DEVICE)
        slot, hidden, outs = harness.new_request(), seeded_randn(3, mc.hidden_size, seed=7), []
        for ids in ([11, 12, 13], [14], [15]):
            batch = harness.build_batch([(slot, ids)])
            harness.attn_backend.init_forward_metadata(batch)
            out = draft(batch.input_ids, batch.positions, batch, hidden.to(torch.bfloat16))
            hidden = out.hidden_states
            outs += [out.logits, out.hidden_states]
        return outs

    monkeypatch.setattr(triton_kernels, "NORM_PROLOGUE_EXACT", True)
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", NONE)
    unfused = run()
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", ALL)
    fused = run()
    assert _counts(triton_on_cpu) == (2 * 3, 2 * 2)  # per step: 1 + 2 norms, 2 SiLUs
    for a, b in zip(fused, unfused, strict=True):
        _exact_or_close(a, b, torch.bfloat16)


def test_applies_only_to_the_plain_pair(monkeypatch, triton_on_cpu, tiny_bf16) -> None:
    """Identity norms (EAGLE layer 0), tensor parallelism, two rows and float32 keep the
    unfused modules."""
    monkeypatch.setattr(triton_kernels, "FUSED_GEMV_PROLOGUES", ALL)
    layer = tiny_bf16()[0].model.layers[0]
    norm, qkv, mlp = layer.input_layernorm, layer.self_attn.qkv_proj, layer.mlp
    x = torch.randn(1, qkv.input_size, dtype=torch.bfloat16)
    gate_up = torch.randn(1, 2 * mlp.down_proj.input_size, dtype=torch.bfloat16)
    applies = fused_linear.rmsnorm_linear_applies
    assert applies(norm, qkv, x, None) and applies(norm, qkv, x, x.clone())
    assert fused_linear.silu_mul_linear_applies(gate_up, mlp.down_proj)
    assert not applies(torch.nn.Identity(), qkv, x, None)
    assert not applies(norm, mlp.down_proj, x, None)  # a row-parallel layer after a norm
    assert not applies(norm, qkv, torch.cat([x, x]), None)
    assert not applies(norm, qkv, x, x.float())
    assert not applies(norm, qkv, x.float(), None)
    assert not fused_linear.silu_mul_linear_applies(torch.cat([gate_up, gate_up]), mlp.down_proj)
    assert not fused_linear.silu_mul_linear_applies(gate_up[:, :-2], mlp.down_proj)
    monkeypatch.setattr(qkv, "tp_size", 2)
    monkeypatch.setattr(mlp.down_proj, "tp_size", 2)
    assert not applies(norm, qkv, x, None)
    assert not fused_linear.silu_mul_linear_applies(gate_up, mlp.down_proj)
