"""The Triton GEMV (layers/triton_kernels/gemv.py) against F.linear, and its dispatch in
the linear layers and the lm_head (on by default on CUDA; SGLANG_TRITON_GEMV=0 turns it off;
one row unless SGLANG_TRITON_GEMV_MAX_ROWS raises it to up to 8).

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported), so the shapes stay small;
with CUDA the same tests run compiled on the GPU. The interpreter computes a bfloat16 tl.dot
wrongly, so the tl.dot kernel (M > 2) is checked in bfloat16 on CUDA only.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers import linear, logits_processor, triton_kernels  # noqa: E402
from sglang.srt.layers.linear import (  # noqa: E402
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor  # noqa: E402
from sglang.srt.layers.triton_kernels import gemv as gemv_module  # noqa: E402
from sglang.srt.layers.triton_kernels.gemv import (  # noqa: E402
    MAX_ROWS,
    GemvTile,
    gemv,
    gemv_dot,
    pick_tile,
)

# Summation order differs from the reference; bf16/fp16 may round one step apart.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _default_device(monkeypatch):
    """Tensors on DEVICE; the GEMV dispatch off unless a test turns it on, and at its default
    row limit (1) whatever SGLANG_TRITON_GEMV_MAX_ROWS this process was started with."""
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", False)
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_MAX_ROWS", 1)
    with torch.device(DEVICE):
        yield


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """x [m, k], weight [n, k] scaled so that outputs are O(1), bias [n]."""
    g = torch.Generator().manual_seed(seed)  # a CPU generator: same draws on every device
    x = torch.randn(m, k, generator=g, device="cpu").to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g, device="cpu") / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g, device="cpu").to(DEVICE, dtype)
    return x, w, b


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64, rounded once to x's dtype (the kernel's contract)."""
    bd = None if b is None else b.double()
    return F.linear(x.double(), w.double(), bd).to(x.dtype)


def _skip_interpreted_bf16_dot(dtype: torch.dtype, dot: bool) -> None:
    if dot and dtype == torch.bfloat16 and not HAS_CUDA:
        pytest.skip("the interpreter's bfloat16 tl.dot is wrong; checked on CUDA")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", [(37, 300), (576, 1536), (8, 8200)])
def test_gemv_matches_linear(dtype, m, with_bias, n, k) -> None:
    """Non-multiples of the tiles (37 x 300: a partial last tile along N and along K), a
    SmolLM2 projection (576 x 1536), the K >= 8192 tile (8 x 8200: N below one dot tile).
    M = 1, 2 run the elementwise kernel, M = 3..8 the tl.dot kernel."""
    _skip_interpreted_bf16_dot(dtype, m > 2)
    x, w, b = _operands(m, n, k, dtype)
    bias = b if with_bias else None
    out = gemv(x, w, bias)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, _ref(x, w, bias), atol=ATOL[dtype], rtol=RTOL[dtype])
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=ATOL[dtype], rtol=RTOL[dtype])


def test_gemv_rows_1_2_keep_the_elementwise_kernel(monkeypatch) -> None:
    """M <= 2 keep the elementwise kernel and its numerics (each row computed alone: row i of
    M = 2 is M = 1 on x[i] bit for bit); gemv_dot, the M > 2 kernel, agrees with it to the
    output's rounding at M = 1, 2 too."""
    x, w, b = _operands(2, 100, 700, torch.float16, seed=4)
    out = gemv(x, w, b)
    dot_out = gemv_dot(x, w, b)
    torch.testing.assert_close(dot_out, out, atol=2e-3, rtol=1e-3)

    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the tl.dot kernel ran for M <= 2")

    monkeypatch.setattr(gemv_module, "_gemv_dot_kernel", _NoLaunch())
    assert torch.equal(gemv(x, w, b), out)
    for i in range(2):
        assert torch.equal(gemv(x[i : i + 1], w, b), out[i : i + 1])


@pytest.mark.parametrize(
    "tile", [GemvTile(16, 256, 4), GemvTile(4, 512, 8), GemvTile(8, 512, 4), GemvTile(2, 64, 1)]
)
def test_gemv_every_tile(tile: GemvTile) -> None:
    x, w, b = _operands(2, 100, 700, torch.bfloat16, seed=1)
    out = gemv(x, w, b, tile=tile)
    torch.testing.assert_close(out, _ref(x, w, b), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize(
    "tile",
    [GemvTile(16, 256, 4), GemvTile(16, 16, 1), GemvTile(32, 128, 4), GemvTile(64, 512, 8)],
)
@pytest.mark.parametrize("m", [3, 8])
def test_gemv_dot_every_tile(tile: GemvTile, m: int) -> None:
    """The tl.dot kernel's tiles (powers of two >= 16) on 100 x 700: partial tiles both ways."""
    x, w, b = _operands(m, 100, 700, torch.float16, seed=1)
    out = gemv(x, w, b, tile=tile)
    torch.testing.assert_close(out, _ref(x, w, b), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_gemv_strided_rows(dtype, m) -> None:
    """x may have any row stride (a slice of a wider tensor) as long as K has stride 1."""
    wide, w, b = _operands(m, 40, 500, dtype, seed=2)
    x = wide[:, 100:400]
    w = w[:, :300].contiguous()
    assert x.stride() == (500, 1)
    torch.testing.assert_close(gemv(x, w, b), _ref(x, w, b), atol=ATOL[dtype], rtol=RTOL[dtype])


@functools.lru_cache(maxsize=1)
def _llama_operands(n: int, k: int):
    """_operands(MAX_ROWS, n, k) in bf16, drawn once per shape (the lm_head's 0.5G draws take
    seconds on the CPU generator); tests take the first m rows."""
    return _operands(MAX_ROWS, n, k, torch.bfloat16, seed=5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize(
    "n,k",
    [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
    ids=["qkv", "o_proj", "gate_up", "down", "lm_head"],
)
def test_cuda_bf16_llama8b_shapes(m: int, n: int, k: int) -> None:
    """Compiled bf16 on the Llama-3.1-8B projections: both kernels against float64 and against
    F.linear (cuBLAS), one bf16 rounding step apart at most; the bias only on qkv (Qwen2-like)."""
    x, w, b = _llama_operands(n, k)
    x = x[:m]
    bias = b if n == 6144 else None
    out = gemv(x, w, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _ref(x, w, bias), atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-2, rtol=1.6e-2)


def test_pick_tile_uses_the_measured_winners() -> None:
    """gemv_h200.json: best tile per Llama-3.1-8B projection at M = 1 on an H200."""
    assert pick_tile(6144, 4096) == GemvTile(8, 512, 4)  # qkv_proj
    assert pick_tile(4096, 4096) == GemvTile(8, 512, 8)  # o_proj
    assert pick_tile(28672, 4096) == GemvTile(16, 256, 4)  # gate_up_proj
    assert pick_tile(4096, 14336) == GemvTile(4, 512, 8)  # down_proj
    assert pick_tile(128256, 4096) == GemvTile(16, 256, 4)  # lm_head
    for m in (1, 2):
        assert pick_tile(4096, 14336, m) == GemvTile(4, 512, 8)
    for m in range(3, MAX_ROWS + 1):  # the tl.dot kernel: not measured yet
        assert pick_tile(4096, 14336, m) == GemvTile(16, 256, 4)


def test_gemv_rejects_unsupported_inputs() -> None:
    x, w, b = _operands(2, 16, 32, torch.bfloat16)
    cases = {
        "M = 9": (torch.randn(9, 32, dtype=torch.bfloat16), w, None),
        "M = 0": (x[:0], w, None),
        "1-D x": (x[0], w, None),
        "K mismatch": (x, w[:, :31].contiguous(), None),
        "dtype mismatch": (x, w.float(), None),
        "integer dtype": (x.to(torch.int32), w.to(torch.int32), None),
        "non-contiguous weight": (x, w.t().contiguous().t(), None),
        "x strided along K": (torch.randn(2, 64, dtype=torch.bfloat16)[:, ::2], w, None),
        "bias shape": (x, w, b[:15]),
        "bias dtype": (x, w, b.float()),
    }
    for what, (xx, ww, bb) in cases.items():
        with pytest.raises(ValueError, match="gemv"):
            gemv(xx, ww, bb)
            pytest.fail(what)
    with pytest.raises(ValueError, match="1..8"):
        gemv(torch.randn(9, 32, dtype=torch.float16), w.half())
    x3 = torch.randn(3, 32, dtype=torch.float16)
    for tile in (GemvTile(8, 512, 4), GemvTile(16, 8, 4), GemvTile(48, 256, 4)):
        with pytest.raises(ValueError, match="power of two >= 16"):
            gemv(x3, w.half(), tile=tile)  # M > 2: tl.dot tiles only


# ------------------------------------------------------------------------------- dispatch


def test_gate_conditions() -> None:
    """gemv_applies: one row after flattening (two go to cuBLAS, measured faster at M = 2),
    fp16/bf16 on both, unit K stride,
    contiguous [N, K] weight; use_triton_gemv also needs the flag and CUDA."""
    bf = torch.bfloat16
    w = torch.randn(16, 32, dtype=bf)
    assert triton_kernels.gemv_applies(torch.randn(1, 32, dtype=bf), w)
    assert not triton_kernels.gemv_applies(torch.randn(2, 32, dtype=bf), w)
    assert not triton_kernels.gemv_applies(torch.randn(2, 1, 32, dtype=bf), w)
    assert triton_kernels.gemv_applies(torch.randn(1, 1, 32, dtype=bf), w)
    assert triton_kernels.gemv_applies(torch.randn(32, dtype=bf), w)
    assert triton_kernels.gemv_applies(torch.randn(1, 32, dtype=torch.float16), w.half())
    assert not triton_kernels.gemv_applies(torch.randn(3, 32, dtype=bf), w)
    assert not triton_kernels.gemv_applies(torch.randn(0, 32, dtype=bf), w)
    assert not triton_kernels.gemv_applies(torch.randn(1, 32), w.float())  # fp32: F.linear
    assert not triton_kernels.gemv_applies(torch.randn(1, 32, dtype=bf), w.half())
    assert not triton_kernels.gemv_applies(torch.randn(1, 64, dtype=bf)[:, ::2], w)
    assert not triton_kernels.gemv_applies(torch.randn(1, 32, dtype=bf), w.t().contiguous().t())
    assert not triton_kernels.gemv_applies(torch.randn(1, 31, dtype=bf), w)
    x = torch.randn(1, 32, dtype=bf)
    assert not triton_kernels.use_triton_gemv(x, w)  # flag off (the autouse fixture)


def test_gate_row_limit() -> None:
    """gemv_applies(x, w, max_rows): 1..max_rows rows after flattening, never above the
    kernel's 8; max_rows None is TRITON_GEMV_MAX_ROWS (SGLANG_TRITON_GEMV_MAX_ROWS, 1 here)."""
    assert triton_kernels.TRITON_GEMV_MAX_ROWS == 1  # the autouse fixture's (the default)
    bf = torch.bfloat16
    w = torch.randn(16, 32, dtype=bf)
    for rows in range(1, 10):
        x = torch.randn(rows, 32, dtype=bf)
        assert triton_kernels.gemv_applies(x, w) == (rows == 1)
        assert triton_kernels.gemv_applies(x, w, None) == (rows == 1)
        for limit in (1, 2, 5, 8, 12):
            assert triton_kernels.gemv_applies(x, w, limit) == (rows <= min(limit, 8))
    assert triton_kernels.gemv_applies(torch.randn(2, 3, 32, dtype=bf), w, 6)  # 6 rows
    assert not triton_kernels.gemv_applies(torch.randn(0, 32, dtype=bf), w, 8)
    assert triton_kernels.GEMV_KERNEL_MAX_ROWS == MAX_ROWS


def test_max_rows_is_read_from_the_environment(monkeypatch) -> None:
    read = triton_kernels._triton_gemv_max_rows
    monkeypatch.delenv("SGLANG_TRITON_GEMV_MAX_ROWS", raising=False)
    assert read() == 1  # today's default: one row
    for value, rows in (("", 1), ("1", 1), ("2", 2), (" 5 ", 5), ("8", 8)):
        monkeypatch.setenv("SGLANG_TRITON_GEMV_MAX_ROWS", value)
        assert read() == rows
    for bad in ("0", "9", "-1", "2.5", "two", "off"):
        monkeypatch.setenv("SGLANG_TRITON_GEMV_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="SGLANG_TRITON_GEMV_MAX_ROWS"):
            read()


def test_flag_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SGLANG_TRITON_GEMV", raising=False)
    monkeypatch.delenv("SGLANG_DISABLE_TRITON_KERNELS", raising=False)
    assert triton_kernels._triton_gemv_enabled()  # on by default
    monkeypatch.setenv("SGLANG_TRITON_GEMV", "0")
    assert not triton_kernels._triton_gemv_enabled()
    monkeypatch.setenv("SGLANG_TRITON_GEMV", "off")
    assert not triton_kernels._triton_gemv_enabled()
    monkeypatch.setenv("SGLANG_TRITON_GEMV", "1")
    assert triton_kernels._triton_gemv_enabled()
    monkeypatch.setenv("SGLANG_DISABLE_TRITON_KERNELS", "1")
    assert not triton_kernels._triton_gemv_enabled()


@pytest.fixture
def gemv_calls(monkeypatch) -> list[tuple[int, int]]:
    """Counts calls to gemv.gemv (the real kernel still runs) as (M, N), and lets the gate pass
    on CPU: use_triton_gemv in the layers becomes the flag and gemv_applies (whose row limit is
    TRITON_GEMV_MAX_ROWS, read when called), without CUDA."""
    calls: list[tuple[int, int]] = []
    real = gemv_module.gemv

    def spy(x, weight, bias=None, **kw):
        calls.append((x.shape[0], weight.shape[0]))
        return real(x, weight, bias, **kw)

    def gate(x, weight):
        return triton_kernels.TRITON_GEMV_ENABLED and triton_kernels.gemv_applies(x, weight)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    monkeypatch.setattr(linear, "use_triton_gemv", gate)
    monkeypatch.setattr(logits_processor, "use_triton_gemv", gate)
    return calls


def _layers(dtype: torch.dtype) -> list:
    torch.manual_seed(3)
    hidden = 64
    layers = [
        ColumnParallelLinear(hidden, 48, bias=True, tp_rank=0, tp_size=1),
        MergedColumnParallelLinear(hidden, [40, 40], bias=False, tp_rank=0, tp_size=1),
        QKVParallelLinear(hidden, 16, 4, 2, bias=True, tp_rank=0, tp_size=1),
        RowParallelLinear(hidden, 32, bias=True, tp_rank=0, tp_size=1),
    ]
    for layer in layers:
        for p in layer.parameters():
            p.data = torch.randn(p.shape).to(DEVICE, dtype) / 8
    return layers


@pytest.mark.parametrize("enabled", [False, True])
def test_linear_layers_call_gemv_only_under_the_gate(monkeypatch, gemv_calls, enabled) -> None:
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", enabled)
    bf = torch.bfloat16
    for layer in _layers(bf):
        n = layer.weight.shape[0]
        for rows in (1, 2, 3):
            gemv_calls.clear()
            x = torch.randn(rows, 64).to(DEVICE, bf)
            out, _ = layer(x)
            expect = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(out, expect, atol=1e-2, rtol=1.6e-2)
            assert gemv_calls == ([(rows, n)] if enabled and rows == 1 else [])
        gemv_calls.clear()
        layer(torch.randn(1, 1, 64).to(DEVICE, bf))  # leading dims flattened
        assert gemv_calls == ([(1, n)] if enabled else [])
    gemv_calls.clear()
    for layer in _layers(torch.float32):
        layer(torch.randn(1, 64))  # float32: F.linear even under the flag
    assert gemv_calls == []


@pytest.mark.parametrize("enabled", [False, True])
def test_lm_head_calls_gemv_only_under_the_gate(monkeypatch, gemv_calls, enabled) -> None:
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", enabled)

    class _Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(70, 32).to(torch.bfloat16) / 6)
            self.bias = None

    class _Config:
        vocab_size = 67  # three padded rows cut off

    proc, head = LogitsProcessor(_Config()), _Head()
    for rows in (1, 2, 3):
        gemv_calls.clear()
        hidden = torch.randn(rows, 32).to(torch.bfloat16)
        logits = proc._compute_logits(hidden, head)
        assert logits.shape == (rows, 67) and logits.dtype == torch.float32
        expect = torch.matmul(hidden, head.weight.t())[:, :67].float()
        torch.testing.assert_close(logits, expect, atol=1e-2, rtol=1.6e-2)
        assert gemv_calls == ([(rows, 70)] if enabled and rows == 1 else [])


@pytest.mark.parametrize("limit", [1, 2, 5, 8])
def test_max_rows_routes_layers_and_lm_head(monkeypatch, gemv_calls, limit) -> None:
    """With SGLANG_TRITON_GEMV_MAX_ROWS = limit, apply_linear (every linear layer) and the
    lm_head send 1..limit rows to the GEMV and more rows to F.linear / torch.matmul; the
    results match F.linear either way. float16: the interpreter's bf16 tl.dot is wrong."""
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", True)
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_MAX_ROWS", limit)
    half = torch.float16
    for layer in _layers(half):
        n = layer.weight.shape[0]
        for rows in range(1, MAX_ROWS + 2):
            gemv_calls.clear()
            x = torch.randn(rows, 64).to(DEVICE, half)
            out, _ = layer(x)
            expect = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(out, expect, atol=2e-3, rtol=1e-3)
            assert gemv_calls == ([(rows, n)] if rows <= limit else [])
    weight = (torch.randn(70, 32) / 6).to(DEVICE, half)
    for rows in range(1, MAX_ROWS + 2):
        gemv_calls.clear()
        out = linear.apply_linear(torch.randn(rows, 1, 32).to(DEVICE, half), weight)
        assert out.shape == (rows, 1, 70)  # leading dims flattened, then restored
        assert gemv_calls == ([(rows, 70)] if rows <= limit else [])
        gemv_calls.clear()
        head = torch.nn.Linear(32, 70, bias=False).to(DEVICE, half)
        proc = LogitsProcessor(type("_Config", (), {"vocab_size": 67})())
        hidden = torch.randn(rows, 32).to(DEVICE, half)
        logits = proc._compute_logits(hidden, head)
        expect = torch.matmul(hidden, head.weight.t())[:, :67].float()
        torch.testing.assert_close(logits, expect, atol=2e-3, rtol=1e-3)
        assert gemv_calls == ([(rows, 70)] if rows <= limit else [])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("limit", [1, 2, 8])
def test_cuda_max_rows_routes_apply_linear(monkeypatch, limit) -> None:
    """On CUDA, the real use_triton_gemv: bf16 apply_linear runs the GEMV for 1..limit rows and
    F.linear beyond, matching F.linear within one bf16 rounding step."""
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_ENABLED", True)
    monkeypatch.setattr(triton_kernels, "TRITON_GEMV_MAX_ROWS", limit)
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(
        gemv_module, "gemv", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b)
    )
    x_all, w, b = _operands(MAX_ROWS + 1, 4096, 4096, torch.bfloat16, seed=6)
    for rows in range(1, MAX_ROWS + 2):
        calls.clear()
        x = x_all[:rows]
        assert triton_kernels.use_triton_gemv(x, w) == (rows <= limit)
        out = linear.apply_linear(x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-2, rtol=1.6e-2)
        assert calls == ([rows] if rows <= limit else [])
