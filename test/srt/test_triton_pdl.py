"""Programmatic dependent launch of the decode-step kernels (layers/triton_kernels/pdl.py).

CPU: the switches (SGLANG_TRITON_PDL, SGLANG_GEMV_PREFETCH_MB), the prefetch-size rule, and that
nothing asks for PDL off CUDA. On a GPU of compute capability >= 9: one decoder layer's chain of
kernels (RMSNorm GEMV with the residual, fused RoPE + KV store, grouped split-K decode and its
merge, o_proj GEMV, RMSNorm GEMV, SiLU-and-mul, down GEMV; four layers, then the final RMSNorm
and the lm_head)
captured in a CUDA graph with PDL and the L2 prefetch on, replayed on fresh inputs, equals the
same chain launched without PDL bit for bit: a kernel that read its input before the kernel
ahead had written it would differ.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers import triton_kernels  # noqa: E402
from sglang.srt.layers.triton_kernels import pdl  # noqa: E402

HAS_PDL_GPU = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize(
    "value, expected", [("", True), ("1", True), ("on", True), ("0", False), ("off", False)]
)
def test_pdl_switch(monkeypatch, value, expected):
    monkeypatch.setenv("SGLANG_TRITON_PDL", value)
    assert triton_kernels._triton_pdl_enabled() is expected


def test_pdl_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("SGLANG_TRITON_PDL", "maybe")
    with pytest.raises(ValueError, match="SGLANG_TRITON_PDL='maybe'"):
        triton_kernels._triton_pdl_enabled()


@pytest.mark.parametrize(
    "value, expected",
    [("", int(triton_kernels.DEFAULT_GEMV_PREFETCH_MB * 2**20)), ("0", 0), ("2.5", 2621440)],
)
def test_prefetch_budget(monkeypatch, value, expected):
    monkeypatch.setenv("SGLANG_GEMV_PREFETCH_MB", value)
    assert triton_kernels._gemv_prefetch_bytes() == expected


@pytest.mark.parametrize("value", ["-1", "lots", "inf", "nan"])
def test_prefetch_budget_rejects(monkeypatch, value):
    monkeypatch.setenv("SGLANG_GEMV_PREFETCH_MB", value)
    with pytest.raises(ValueError, match="SGLANG_GEMV_PREFETCH_MB"):
        triton_kernels._gemv_prefetch_bytes()


def test_prefetch_cols_rule(monkeypatch):
    monkeypatch.setattr(pdl, "GEMV_PREFETCH_BYTES", 16 * 2**20)
    # Llama-3.1-8B bf16 shapes: o_proj, qkv, gate_up, down, lm_head
    assert pdl.prefetch_cols(4096, 4096, 2, True) == 2048
    assert pdl.prefetch_cols(6144, 4096, 2, True) == 1024
    assert pdl.prefetch_cols(28672, 4096, 2, True) == 256
    assert pdl.prefetch_cols(4096, 14336, 2, True) == 2048
    assert pdl.prefetch_cols(128256, 4096, 2, True) == 64  # one 128-byte line per row
    # capped by K, rounded down to a power of two; float32 lines hold 32 elements
    assert pdl.prefetch_cols(64, 576, 2, True) == 512
    assert pdl.prefetch_cols(64, 576, 4, True) == 512
    # under one line per row, without PDL, or an empty weight: nothing
    assert pdl.prefetch_cols(200000, 4096, 2, True) == 0
    assert pdl.prefetch_cols(4096, 4096, 2, False) == 0
    assert pdl.prefetch_cols(0, 4096, 2, True) == 0
    assert pdl.prefetch_cols(8, 32, 2, True) == 0  # K shorter than one line
    monkeypatch.setattr(pdl, "GEMV_PREFETCH_BYTES", 0)
    assert pdl.prefetch_cols(4096, 4096, 2, True) == 0


def test_no_pdl_off_cuda_or_when_off(monkeypatch):
    cpu = torch.zeros(4)
    assert pdl.launch_args(cpu) == {"USE_PDL": False}
    if HAS_PDL_GPU:
        gpu = torch.zeros(4, device="cuda")
        assert pdl.launch_args(gpu) == {"USE_PDL": True, "launch_pdl": True}
        monkeypatch.setattr(pdl, "TRITON_PDL_ENABLED", False)
        assert pdl.launch_args(gpu) == {"USE_PDL": False}


# One small Llama-shaped layer: hidden 256, 4 query heads and 2 KV heads of 64, MLP 512; an
# lm_head of 999 rows, not a multiple of any tile, so the prefetch clamps its last rows.
HIDDEN, HQ, HKV, HEAD, INTER, LAYERS, CONTEXT, VOCAB = 256, 4, 2, 64, 512, 4, 300, 999


def _weights(gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def rnd(*shape, scale=0.05):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    def norm():
        return (1.0 + torch.randn(HIDDEN, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)

    return [
        {
            "ln1": norm(),
            "qkv": rnd((HQ + 2 * HKV) * HEAD, HIDDEN),
            "o": rnd(HIDDEN, HQ * HEAD),
            "ln2": norm(),
            "gate_up": rnd(2 * INTER, HIDDEN),
            "down": rnd(HIDDEN, INTER),
        }
        for _ in range(LAYERS)
    ]


class _Chain:
    """The decode step of a LAYERS-layer model at batch 1, as the kernels the layers launch,
    with its own KV cache (CONTEXT earlier tokens, then this token's slot)."""

    def __init__(self, weights, gen_state: torch.Tensor) -> None:
        from sglang.srt.layers.attention.triton_ops.decode_attention import (
            alloc_decode_partials,
        )

        gen = torch.Generator().set_state(gen_state)
        self.w = weights
        self.lm_head = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(torch.bfloat16)
        self.lm_head = self.lm_head.to(DEVICE)
        slots = CONTEXT + 1
        self.k_cache = [
            torch.randn(slots, HKV, HEAD, generator=gen).to(torch.bfloat16).to(DEVICE)
            for _ in range(LAYERS)
        ]
        self.v_cache = [
            torch.randn(slots, HKV, HEAD, generator=gen).to(torch.bfloat16).to(DEVICE)
            for _ in range(LAYERS)
        ]
        self.req_to_token = torch.arange(slots, dtype=torch.int32, device=DEVICE)[None, :]
        self.rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        self.seq_lens = torch.full((1,), slots, dtype=torch.int64, device=DEVICE)
        self.positions = torch.full((1,), CONTEXT, dtype=torch.int64, device=DEVICE)
        self.loc = torch.full((1,), CONTEXT, dtype=torch.int64, device=DEVICE)
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))
        ang = torch.arange(CONTEXT + 8, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(DEVICE)
        self.splits = 8
        self.partials = alloc_decode_partials(1, HQ, HEAD, self.splits, DEVICE)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
        from sglang.srt.layers.triton_kernels.activation import silu_and_mul
        from sglang.srt.layers.triton_kernels.gemv import gemv
        from sglang.srt.layers.triton_kernels.gemv_prologue import gemv_rmsnorm
        from sglang.srt.layers.triton_kernels.rmsnorm import rmsnorm
        from sglang.srt.layers.triton_kernels.rope_kv import rope_and_store_kv

        h, res = x, torch.zeros_like(x)
        for i, w in enumerate(self.w):
            qkv, res = gemv_rmsnorm(h, w["ln1"], 1e-5, w["qkv"], residual=res)
            q, k, v = qkv.split([HQ * HEAD, HKV * HEAD, HKV * HEAD], dim=-1)
            q, k = rope_and_store_kv(
                self.positions, q, k, v, self.cos_sin, HEAD, HEAD,
                self.k_cache[i], self.v_cache[i], self.loc,
            )  # fmt: skip
            attn = torch.empty(1, HQ, HEAD, dtype=x.dtype, device=x.device)
            decode_attention_fwd(
                q.reshape(1, HQ, HEAD), self.k_cache[i], self.v_cache[i], attn,
                self.req_to_token, self.rows, self.seq_lens, HEAD**-0.5,
                num_splits=self.splits, partials=self.partials, grouped=True,
            )  # fmt: skip
            o = gemv(attn.view(1, HQ * HEAD), w["o"])
            gate_up, res = gemv_rmsnorm(o, w["ln2"], 1e-5, w["gate_up"], residual=res)
            h = gemv(silu_and_mul(gate_up), w["down"])
        out, _ = rmsnorm(h, self.w[0]["ln1"], 1e-5, residual=res)
        return gemv(out, self.lm_head)


@pytest.mark.skipif(not HAS_PDL_GPU, reason="needs a GPU of compute capability >= 9 (PDL)")
def test_graph_with_pdl_equals_chain_without(monkeypatch):
    from sglang.srt.layers.triton_kernels.gemv import pdl_gemv_args

    monkeypatch.setattr(pdl, "GEMV_PREFETCH_BYTES", 2**20)  # the prefetch too (off by default)
    gen = torch.Generator().manual_seed(0)
    weights = _weights(gen)
    cache_state = torch.Generator().manual_seed(1).get_state()
    assert pdl.launch_args(weights[0]["o"])["USE_PDL"]
    assert pdl_gemv_args(weights[0]["gate_up"])["PF_K"] > 0  # the prefetch is compiled in

    graph_chain, plain_chain = _Chain(weights, cache_state), _Chain(weights, cache_state)
    static_x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph_chain.step(static_x)  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graph_chain.step(static_x)

    inputs = torch.Generator().manual_seed(2)
    for _ in range(20):
        x = torch.randn(1, HIDDEN, generator=inputs).to(torch.bfloat16).cuda()
        static_x.copy_(x)
        graph.replay()
        with monkeypatch.context() as m:
            m.setattr(pdl, "TRITON_PDL_ENABLED", False)
            expected = plain_chain.step(x)
        torch.cuda.synchronize()
        assert torch.isfinite(expected.float()).all()
        assert torch.equal(static_out, expected)
        for i in range(LAYERS):
            assert torch.equal(graph_chain.k_cache[i], plain_chain.k_cache[i])
            assert torch.equal(graph_chain.v_cache[i], plain_chain.v_cache[i])
