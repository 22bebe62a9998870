"""RoPE fused with the KV store (layers/triton_kernels/rope_kv.py) against the rotary kernel
followed by the KV-store kernel (bit for bit) and against the PyTorch path (tolerance).

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported), so the shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope  # noqa: E402
from sglang.srt.layers.triton_kernels.kv_store import store_kv  # noqa: E402
from sglang.srt.layers.triton_kernels.rope_kv import rope_and_store_kv  # noqa: E402
from sglang.srt.layers.triton_kernels.rotary import rotary_embedding_  # noqa: E402

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
