"""RoPE and the KV-cache store of one attention layer as one kernel, where the step allows it.

Unfused, a layer runs the rotary kernel on q and k, then the attention backend stores k and v
into the KV pool at forward_batch.out_cache_loc (``pool.set_kv_buffer``: the kv_store kernel on
CUDA). ``rope_and_save_kv`` does both with triton_kernels/rope_kv.py and tells the caller to
call the attention with ``save_kv_cache=False``; when the step does not qualify it runs the
rotary embedding alone and the backend stores as before. Bit for bit the same KV pool and q.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.triton_kernels import use_fused_rope_decode, use_fused_rope_kv
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from sglang.srt.layers.attention.triton_ops.decode_grouped import DecodeRope
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# The forward modes in which the attention backend stores the step's K/V (not IDLE).
STORING_MODES = (
    ForwardMode.DECODE,
    ForwardMode.EXTEND,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND,
)


def fused_rope_kv_applies(
    rotary_emb: torch.nn.Module,
    attn: RadixAttention,
    q: torch.Tensor,  # [T, Hq * D]
    k: torch.Tensor,  # [T, Hkv * D]
    forward_batch: ForwardBatch,
) -> bool:
    """The device-free conditions of the fusion: the backend saves K/V only through
    ``pool.set_kv_buffer(layer_id, out_cache_loc, k, v)`` (``saves_kv_through_pool``: triton,
    flashinfer; not torch_native), the pool is a plain MHATokenToKVPool whose dtype is k's and
    q's (no fp8 / scaled cache) and whose layer has this layer's heads and head_dim, the mode
    is one that stores (decode, extend, target verify, draft extend), the rotary embedding is
    the plain neox RotaryEmbedding over this head_dim, and every token has a cache slot."""
    pool = forward_batch.token_to_kv_pool
    return (
        getattr(forward_batch.attn_backend, "saves_kv_through_pool", False)
        and type(pool) is MHATokenToKVPool
        and forward_batch.forward_mode in STORING_MODES
        and type(rotary_emb) is RotaryEmbedding
        and rotary_emb.is_neox_style
        and rotary_emb.head_size == attn.head_dim
        and q.dtype == k.dtype == pool.dtype
        and (pool.head_num, pool.head_dim) == (attn.tp_k_head_num, attn.head_dim)
        and 0 <= attn.layer_id < pool.layer_num
        and forward_batch.out_cache_loc.shape[0] == q.shape[0] == k.shape[0]
    )


def decode_rope(
    rotary_emb: torch.nn.Module,
    attn: RadixAttention,
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq * D], may be a strided view of the fused qkv
    k: torch.Tensor,  # [T, Hkv * D], same
    v: torch.Tensor,  # [T, Hkv * D], same
    forward_batch: ForwardBatch,
) -> DecodeRope | None:
    """The layer's RoPE and KV store for the attention backend's decode kernel to do
    (attention/triton_ops/decode_grouped.DecodeRope; call ``attn(q, k, v, forward_batch,
    save_kv_cache=False, rope=...)`` with q and k unrotated), or None: then rope_and_save_kv.
    Applies when ``use_fused_rope_decode(q)`` (CUDA, SGLANG_FUSED_ROPE_DECODE on), the step is
    a decode step, ``fused_rope_kv_applies`` holds, the rotation covers the whole head
    (rotary_dim == head_dim), k and v have a unit last stride, and the step's backend says it
    can (``fuses_decode_rope``: the Triton backend with its grouped decode kernel) and will run
    its decode kernel (its metadata's is_decode)."""
    if not (
        use_fused_rope_decode(q)
        and forward_batch.forward_mode == ForwardMode.DECODE
        and getattr(forward_batch.attn_backend, "fuses_decode_rope", False)
        and getattr(forward_batch.attn_metadata, "is_decode", False)  # the decode kernel runs
        and fused_rope_kv_applies(rotary_emb, attn, q, k, forward_batch)
        and rotary_emb.rotary_dim == rotary_emb.head_size
        and k.stride(-1) == 1
        and v.stride(-1) == 1
    ):
        return None
    from sglang.srt.layers.attention.triton_ops.decode_grouped import DecodeRope

    cs = rotary_emb.cos_sin_cache
    cs = cs if cs.stride(-1) == 1 else cs.contiguous()
    return DecodeRope(positions, cs, k, v, forward_batch.out_cache_loc)


def rope_and_save_kv(
    rotary_emb: RotaryEmbedding,
    attn: RadixAttention,
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq * D], may be a strided view of the fused qkv
    k: torch.Tensor,  # [T, Hkv * D], same
    v: torch.Tensor,  # [T, Hkv * D], same
    forward_batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """RoPE on q and k (in place on CUDA, as ``rotary_emb`` does), and, when the fusion applies
    (``use_fused_rope_kv(q)``: CUDA, the Triton kernels on, SGLANG_FUSED_ROPE_KV not "0"; and
    ``fused_rope_kv_applies``), the store of the rotated k and v into layer attn.layer_id of
    forward_batch.token_to_kv_pool at forward_batch.out_cache_loc in the same kernel.

    Returns (q, k, kv_saved); call ``attn(q, k, v, forward_batch, save_kv_cache=not kv_saved)``.
    No host synchronisation: safe under CUDA-graph capture. Errors: those of the rotary
    embedding (e.g. IndexError for positions past the cache on the PyTorch path).
    """
    if use_fused_rope_kv(q) and fused_rope_kv_applies(rotary_emb, attn, q, k, forward_batch):
        from sglang.srt.layers.triton_kernels.rope_kv import rope_and_store_kv

        pool = forward_batch.token_to_kv_pool
        q, k = rope_and_store_kv(
            positions,
            q,
            k,
            v,
            rotary_emb.cos_sin_cache,
            rotary_emb.head_size,
            rotary_emb.rotary_dim,
            pool.get_key_buffer(attn.layer_id),
            pool.get_value_buffer(attn.layer_id),
            forward_batch.out_cache_loc,
        )
        return q, k, True
    q, k = rotary_emb(positions, q, k)
    return q, k, False
