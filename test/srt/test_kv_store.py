"""The one-kernel KV store (layers/triton_kernels/kv_store.py) against the pool's indexed writes.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported); with CUDA it runs compiled.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers import triton_kernels  # noqa: E402
from sglang.srt.layers.triton_kernels.kv_store import store_kv  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402


def _reference(pool: MHATokenToKVPool, layer: int, loc, k, v) -> tuple:
    """The PyTorch path of set_kv_buffer on copies of the layer's caches."""
    kc, vc = pool.k_buffer[layer].clone(), pool.v_buffer[layer].clone()
    kc[loc] = k.to(pool.dtype)
    vc[loc] = v.to(pool.dtype)
    return kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (2, 24), (1, 2048)])
def test_store_kv_equals_indexed_writes(dtype, heads, head_dim) -> None:
    """Scattered slots, rows that are strided views of a fused qkv output (as LlamaAttention
    splits them), k in another dtype (cast to the cache's), a head row wider than one block."""
    torch.manual_seed(0)
    pool = MHATokenToKVPool(40, dtype, heads, head_dim, layer_num=2, device=DEVICE)
    t = 7
    loc = torch.tensor([5, 39, 1, 17, 22, 8, 30], device=DEVICE)
    width = heads * head_dim
    qkv = torch.randn(t, 4 * width, device=DEVICE).to(dtype)  # q (2 widths) | k | v
    k = qkv[:, 2 * width : 3 * width].view(t, heads, head_dim)
    v = qkv[:, 3 * width :].view(t, heads, head_dim)
    k32 = k.float()  # another dtype than the cache
    want_k, want_v = _reference(pool, 1, loc, k32, v)
    store_kv(pool.k_buffer[1], pool.v_buffer[1], loc, k32, v)
    assert torch.equal(pool.k_buffer[1], want_k) and torch.equal(pool.v_buffer[1], want_v)
    assert not pool.k_buffer[0].any() and not pool.v_buffer[0].any()  # other layer untouched


def test_store_kv_padding_slot_and_empty() -> None:
    """CUDA-graph padding writes several rows to slot 0: the real slots are exact and slot 0
    holds one of the padded rows; no tokens is a no-op."""
    pool = MHATokenToKVPool(10, torch.float32, 2, 8, layer_num=1, device=DEVICE)
    loc = torch.tensor([3, 0, 0, 0], device=DEVICE)
    k = torch.arange(4 * 16, dtype=torch.float32, device=DEVICE).view(4, 2, 8)
    v = -k
    store_kv(pool.k_buffer[0], pool.v_buffer[0], loc, k, v)
    assert torch.equal(pool.k_buffer[0][3], k[0]) and torch.equal(pool.v_buffer[0][3], v[0])
    assert any(torch.equal(pool.k_buffer[0][0], k[i]) for i in (1, 2, 3))
    empty = torch.empty(0, 2, 8, device=DEVICE)
    store_kv(pool.k_buffer[0], pool.v_buffer[0], loc[:0], empty, empty)


def test_store_kv_rejects_mismatched_shapes() -> None:
    pool = MHATokenToKVPool(10, torch.float32, 2, 8, layer_num=1, device=DEVICE)
    kc, vc = pool.k_buffer[0], pool.v_buffer[0]
    loc = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="2 slots"):
        store_kv(kc, vc, loc, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match="cache rows of 16"):
        store_kv(kc, vc, loc, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(kc[:, :, :4], vc[:, :, :4], loc, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))


def test_set_kv_buffer_uses_the_kernel_only_when_enabled(monkeypatch) -> None:
    """MHATokenToKVPool.set_kv_buffer dispatches to store_kv under use_triton_kernels (CUDA and
    the Triton kernels enabled) and keeps the indexed writes otherwise; both give the same
    cache. On CPU the CUDA condition is stood in for."""
    import sglang.srt.layers.triton_kernels.kv_store as kv_store
    import sglang.srt.mem_cache.memory_pool as memory_pool

    calls = []
    real = kv_store.store_kv
    monkeypatch.setattr(kv_store, "store_kv", lambda *a: calls.append(1) or real(*a))
    pools = []
    k = torch.randn(3, 2, 8, device=DEVICE)
    for enabled in (False, True):
        monkeypatch.setattr(memory_pool, "use_triton_kernels", lambda t, *more, e=enabled: e)
        pool = MHATokenToKVPool(12, torch.float32, 2, 8, layer_num=1, device=DEVICE)
        pool.set_kv_buffer(0, torch.tensor([4, 9, 2], device=DEVICE), k, k * 2)
        pools.append(pool)
    assert calls == [1]
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
    assert triton_kernels.use_triton_kernels(torch.zeros(1)) is False  # a CPU tensor never
