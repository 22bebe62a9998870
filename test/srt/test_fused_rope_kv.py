"""RoPE fused with the KV store (layers/triton_kernels/rope_kv.py) against the rotary kernel
followed by the KV-store kernel (bit for bit) and against the PyTorch path (tolerance); its
dispatch (layers/fused_rope_kv.py) in a tiny Llama's forward, and SGLANG_FUSED_ROPE_KV.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported), so the shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE, compiled_variants  # first: TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers import fused_rope_kv, rotary_embedding, triton_kernels  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope  # noqa: E402
from sglang.srt.layers.triton_kernels import rope_kv  # noqa: E402
from sglang.srt.layers.triton_kernels.kv_store import store_kv  # noqa: E402
from sglang.srt.layers.triton_kernels.rope_kv import rope_and_store_kv  # noqa: E402
from sglang.srt.layers.triton_kernels.rotary import rotary_embedding_  # noqa: E402
from sglang.srt.mem_cache import memory_pool  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_loader import get_model  # noqa: E402
from sglang.srt.speculative.draft_config import load_draft_model  # noqa: E402
from sglang.test.forward_harness import ForwardHarness  # noqa: E402
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir  # noqa: E402
from sglang.test.tiny_llama_steps import ragged_prefill_then_decode  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


def _case(t: int, hq: int, hk: int, head: int, dtype: torch.dtype, slots: int = 40, seed: int = 0):
    """qkv [t, (hq + 2 hk) * head] (q, k, v are strided views of it, as LlamaAttention splits
    them), positions [t] up to 4095, t distinct scattered slots, caches of random contents."""
    g = torch.Generator().manual_seed(seed)  # CPU draws: same values on every device
    qkv = torch.randn(t, (hq + 2 * hk) * head, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    loc = (torch.randperm(slots - 1, generator=g)[:t] + 1).to(DEVICE)
    k_cache = torch.randn(slots, hk, head, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(slots, hk, head, generator=g).to(DEVICE, dtype)
    return qkv, positions, loc, k_cache, v_cache


def _split(qkv: torch.Tensor, hq: int, hk: int, head: int):
    return qkv.split([hq * head, hk * head, hk * head], dim=-1)


_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


SHAPES = [  # t, hq, hk, head, rotary_dim
    (1, 4, 2, 64, 64),  # one decode token, GQA
    (5, 9, 3, 64, 64),  # SmolLM2 heads, a ragged step
    (3, 4, 2, 48, 32),  # partial rotary (the rest of each head is copied)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,head,rotary_dim", SHAPES)
def test_equals_rotary_then_store_bit_for_bit(dtype, t, hq, hk, head, rotary_dim) -> None:
    rope = get_rope(head, rotary_dim, 4096, 500000.0, _LLAMA3)  # llama3 scaling in the cache
    qkv, positions, loc, k_cache, v_cache = _case(t, hq, hk, head, dtype)
    want_qkv, want_kc, want_vc = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = _split(want_qkv, hq, hk, head)
    rotary_embedding_(positions, q, k, rope.cos_sin_cache.to(DEVICE), head, rotary_dim)
    store_kv(want_kc, want_vc, loc, k.view(t, hk, head), v.view(t, hk, head))

    q, k, v = _split(qkv, hq, hk, head)
    out_q, out_k = rope_and_store_kv(
        positions, q, k, v, rope.cos_sin_cache.to(DEVICE), head, rotary_dim, k_cache, v_cache, loc
    )
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(qkv, want_qkv)  # rotated q and k, v untouched
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,head,rotary_dim", SHAPES[1:])
def test_matches_the_pytorch_path(dtype, t, hq, hk, head, rotary_dim) -> None:
    """RotaryEmbedding's PyTorch code and the pool's indexed writes, on the same inputs; int32
    positions and slots, 3-D q/k/v."""
    with torch.device("cpu"):
        rope = RotaryEmbedding(head, rotary_dim, 4096, 10000.0)
    qkv, positions, loc, k_cache, v_cache = _case(t, hq, hk, head, dtype, seed=1)
    q, k, v = (x.cpu() for x in _split(qkv, hq, hk, head))
    ref_q, ref_k = rope(positions.cpu(), q.clone(), k.clone())
    ref_kc, ref_vc = k_cache.cpu(), v_cache.cpu()
    ref_kc[loc.cpu()] = ref_k.view(t, hk, head)
    ref_vc[loc.cpu()] = v.view(t, hk, head)

    q3, k3, v3 = (x.reshape(t, -1, head) for x in _split(qkv, hq, hk, head))
    rope_and_store_kv(
        positions.int(),
        q3,
        k3,
        v3,
        rope.cos_sin_cache.to(DEVICE),
        head,
        rotary_dim,
        k_cache,
        v_cache,
        loc.int(),
    )
    tol = dict(atol=ATOL[dtype], rtol=RTOL[dtype])
    torch.testing.assert_close(q3.reshape(t, -1).cpu(), ref_q, **tol)
    torch.testing.assert_close(k3.reshape(t, -1).cpu(), ref_k, **tol)
    torch.testing.assert_close(k_cache.cpu(), ref_kc, **tol)
    assert torch.equal(v_cache.cpu(), ref_vc)  # v is copied


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled Triton kernels need CUDA")
def test_index_views_at_any_offset_reuse_one_compiled_kernel() -> None:
    """positions and KV slots reach these kernels as views at offsets that follow the step's
    shape (int64_to_device's split); token counts change every step. After the first call
    per kernel, none of that compiles another variant mid-serving (the variants of a page-list
    kernel cost the H200 8% of a loaded scheduler's time, benchmark/README.md, fifteenth
    session)."""
    from sglang.srt.layers.triton_kernels import kv_store, rotary

    kernels = [rope_kv._rope_store_kv_kernel, kv_store._store_kv_kernel, rotary._rope_kernel]
    compiled_variants(*kernels)  # skips where Triton keeps no cache to inspect
    hq, hk, head = 9, 3, 64
    cos_sin = torch.randn(4096, head, device="cuda")
    counts = None
    for i, t in enumerate([1, 16, 17, 33, 5]):
        qkv, positions, loc, k_cache, v_cache = _case(t, hq, hk, head, torch.bfloat16, 64, i)
        off = i % 2  # the index vectors as views at element offset 1 every other step
        positions = torch.cat([positions[:1], positions])[off : off + t]
        loc = torch.cat([loc[:1], loc])[off : off + t]
        q, k, v = _split(qkv, hq, hk, head)
        rope_and_store_kv(positions, q, k, v, cos_sin, head, head, k_cache, v_cache, loc)
        store_kv(k_cache, v_cache, loc, k, v)
        rotary_embedding_(positions, q, k, cos_sin, head, head)
        now = compiled_variants(*kernels)
        counts = counts or now  # other tests of this process may have compiled other shapes
        assert now == counts
    torch.cuda.synchronize()


def test_empty_step_and_bad_shapes() -> None:
    qkv, positions, loc, kc, vc = _case(2, 2, 1, 16, torch.float32)
    q, k, v = _split(qkv, 2, 1, 16)
    cache = get_rope(16, 16, 4096, 10000.0).cos_sin_cache.to(DEVICE)
    before = kc.clone()
    rope_and_store_kv(positions[:0], q[:0], k[:0], v[:0], cache, 16, 16, kc, vc, loc[:0])
    assert torch.equal(kc, before)
    with pytest.raises(ValueError, match="slots"):
        rope_and_store_kv(positions, q, k, v, cache, 16, 16, kc, vc, loc[:1])
    with pytest.raises(ValueError, match="caches of shape"):
        rope_and_store_kv(
            positions, q, k, v, cache, 16, 16, kc[..., :8].clone(), vc[..., :8].clone(), loc
        )
    with pytest.raises(ValueError, match="contiguous"):
        rope_and_store_kv(positions, q, k, v, cache, 16, 16, kc[::2], vc[::2], loc)
    with pytest.raises(ValueError, match="dtype"):
        rope_and_store_kv(positions, q, k.half(), v, cache, 16, 16, kc, vc, loc)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_and_store_kv(positions, q, k, v, cache, 16, 15, kc, vc, loc)


# ------------------------------------------------------------------------------- dispatch


def test_flag_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SGLANG_FUSED_ROPE_KV", raising=False)
    monkeypatch.delenv("SGLANG_DISABLE_TRITON_KERNELS", raising=False)
    assert triton_kernels._fused_rope_kv_enabled()  # on by default
    for off in ("0", "off", "false"):
        monkeypatch.setenv("SGLANG_FUSED_ROPE_KV", off)
        assert not triton_kernels._fused_rope_kv_enabled()
    monkeypatch.setenv("SGLANG_FUSED_ROPE_KV", "1")
    assert triton_kernels._fused_rope_kv_enabled()
    monkeypatch.setenv("SGLANG_DISABLE_TRITON_KERNELS", "1")
    assert not triton_kernels._fused_rope_kv_enabled()
    monkeypatch.setattr(triton_kernels, "FUSED_ROPE_KV_ENABLED", True)
    assert not triton_kernels.use_fused_rope_kv(torch.zeros(1, device="cpu"))  # CUDA only


def test_gate_conditions() -> None:
    """Backends that store through the pool (triton, flashinfer) in the storing modes, a pool
    of q/k's dtype with the layer's heads; anything else keeps the unfused path."""
    harness = _harness_for_gate()
    fb = harness.build_batch([(harness.new_request(), [1, 2, 3])])
    rope = get_rope(16, 16, 2048, 10000.0)
    attn = RadixAttention(4, 16, 0.25, 2, layer_id=1)
    q, k = torch.zeros(3, 64, device=DEVICE), torch.zeros(3, 32, device=DEVICE)

    def applies(**changes) -> bool:
        saved = {name: getattr(fb, name) for name in changes}
        for name, value in changes.items():
            setattr(fb, name, value)
        try:
            return fused_rope_kv.fused_rope_kv_applies(rope, attn, q, k, fb)
        finally:
            for name, value in saved.items():
                setattr(fb, name, value)

    fb.attn_backend = TritonAttnBackend()
    for mode in ForwardMode:
        assert applies(forward_mode=mode) == (mode != ForwardMode.IDLE)
    assert not applies(attn_backend=TorchNativeAttnBackend())
    assert not applies(attn_backend=None)
    half_pool = MHATokenToKVPool(16, torch.float16, 2, 16, 2, DEVICE)  # another dtype
    assert not applies(token_to_kv_pool=half_pool)
    assert not applies(token_to_kv_pool=MHATokenToKVPool(16, torch.float32, 1, 16, 2, DEVICE))
    assert not applies(token_to_kv_pool=MHATokenToKVPool(16, torch.float32, 2, 16, 1, DEVICE))
    assert not applies(out_cache_loc=fb.out_cache_loc[:2])
    assert not fused_rope_kv.fused_rope_kv_applies(rope, attn, q.half(), k.half(), fb)


def _harness_for_gate() -> ForwardHarness:
    class _Cfg:  # what ForwardHarness reads from a ModelConfig
        context_len, dtype, head_dim, num_hidden_layers = 64, torch.float32, 16, 2

        @staticmethod
        def get_num_kv_heads(tp: int) -> int:
            return 2

    return ForwardHarness(None, _Cfg(), max_total_tokens=16, max_requests=2, device=DEVICE)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """Records "fused" per rope_and_store_kv call and "store" per set_kv_buffer call (the real
    code still runs). The layers take the Triton path on CPU as they would on CUDA: the rotary
    kernel, the KV-store kernel, and the fused one under FUSED_ROPE_KV_ENABLED (set by each
    test)."""
    calls: list[str] = []
    fused, store = rope_kv.rope_and_store_kv, MHATokenToKVPool.set_kv_buffer
    monkeypatch.setattr(rope_kv, "rope_and_store_kv", lambda *a: calls.append("fused") or fused(*a))
    monkeypatch.setattr(
        MHATokenToKVPool, "set_kv_buffer", lambda *a: calls.append("store") or store(*a)
    )
    monkeypatch.setattr(rotary_embedding, "use_triton_kernels", lambda t, *more: True)
    monkeypatch.setattr(memory_pool, "use_triton_kernels", lambda t, *more: True)
    gate = lambda t: triton_kernels.FUSED_ROPE_KV_ENABLED  # noqa: E731
    monkeypatch.setattr(fused_rope_kv, "use_fused_rope_kv", gate)
    return calls


def _prefill_then_decode(
    model_dir: str, backend_cls, dtype: str = "bfloat16"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """ragged_prefill_then_decode with one decode step: the logits of both steps and the KV
    pool's k and v buffers."""
    return ragged_prefill_then_decode(model_dir, backend_cls, dtype, DEVICE, decode_steps=1)


def test_tiny_llama_fused_equals_unfused(tiny_model_dir, monkeypatch, kernel_calls) -> None:
    """In bf16 the fused forward (2 layers x 2 steps = 4 fused calls) gives the unfused
    forward's logits and KV pool bit for bit; the flag (FUSED_ROPE_KV_ENABLED, from
    SGLANG_FUSED_ROPE_KV) turns it off."""
    monkeypatch.setattr(triton_kernels, "FUSED_ROPE_KV_ENABLED", True)
    fused_logits, fused_kv = _prefill_then_decode(tiny_model_dir, TritonAttnBackend)
    assert kernel_calls == ["fused"] * 4  # the backend did not store again
    monkeypatch.setattr(triton_kernels, "FUSED_ROPE_KV_ENABLED", False)  # SGLANG_FUSED_ROPE_KV=0
    logits, kv = _prefill_then_decode(tiny_model_dir, TritonAttnBackend)
    assert kernel_calls == ["fused"] * 4 + ["store"] * 4  # the flag turned it off
    assert all(torch.equal(x, y) for x, y in zip(fused_logits, logits, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(fused_kv, kv, strict=True))
    # 9 tokens: slots 6-14 of every layer's k and v written, nothing else
    assert all(x.flatten(1).any(1).nonzero().flatten().tolist() == [*range(6, 15)] for x in kv)


def test_tiny_llama_fused_matches_the_cpu_path(tiny_model_dir, monkeypatch, kernel_calls) -> None:
    """In float32 the fused forward matches the default path with torch_native attention (on
    CPU: PyTorch rotary, indexed KV writes) to float32 rounding."""
    monkeypatch.setattr(triton_kernels, "FUSED_ROPE_KV_ENABLED", True)
    fused_logits, fused_kv = _prefill_then_decode(tiny_model_dir, TritonAttnBackend, "float32")
    assert kernel_calls == ["fused"] * 4
    monkeypatch.undo()
    logits, kv = _prefill_then_decode(tiny_model_dir, TorchNativeAttnBackend, "float32")
    for x, y in zip(fused_logits + fused_kv, logits + kv, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_torch_native_stays_unfused(tiny_model_dir, monkeypatch, kernel_calls) -> None:
    monkeypatch.setattr(triton_kernels, "FUSED_ROPE_KV_ENABLED", True)
    _prefill_then_decode(tiny_model_dir, TorchNativeAttnBackend)
    assert kernel_calls == ["store"] * 4


def test_eagle3_draft_extend_fused_equals_unfused(
    tiny_model_dir, tmp_path, monkeypatch, kernel_calls
) -> None:
    """The EAGLE-3 draft's layer is a LlamaAttention over its own one-layer pool: a draft
    extend (ForwardMode.DRAFT_EXTEND) gives the same logits, hidden states and draft KV fused
    and unfused."""
    cfg = ModelConfig(tiny_model_dir, dtype="bfloat16")
    target = get_model(cfg, device=DEVICE)
    draft_dir = make_tiny_eagle3_dir(str(tmp_path / "eagle3"), tiny_model_dir, None, std=0.2)
    draft = load_draft_model(draft_dir, target, cfg, DEVICE, torch.bfloat16)
    aux = torch.randn(5, 3 * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(triton_kernels, "FUSED_ROPE_KV_ENABLED", enabled)
        h = ForwardHarness(draft, ModelConfig(draft_dir, dtype="bfloat16"), device=DEVICE)
        h.attn_backend = TritonAttnBackend()
        reqs = [(h.new_request(), [5, 17, 300]), (h.new_request(), [42, 7])]
        batch = h.build_batch(reqs, forward_mode=ForwardMode.DRAFT_EXTEND)
        h.attn_backend.init_forward_metadata(batch)
        out = draft(batch.input_ids, batch.positions, batch, aux.to(DEVICE, torch.bfloat16))
        pool = h.token_to_kv_pool
        results.append([out.logits, out.hidden_states, pool.k_buffer[0], pool.v_buffer[0]])
    assert kernel_calls == ["fused", "store"]
    assert [int(x.flatten(1).any(1).sum()) for x in results[0][2:]] == [5, 5]  # 5 tokens' K/V
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))
