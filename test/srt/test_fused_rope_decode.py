"""RoPE and the KV store inside the grouped decode kernel (decode_grouped.DecodeRope,
SGLANG_FUSED_ROPE_DECODE): against rope_kv.py's kernel followed by the same decode kernel, the
attention output and the KV pool are equal bit for bit (requests of different lengths, one and
several splits, GQA groups of 1, 4 and 8), bad arguments raise, and a tiny Llama's decode
steps through the Triton backend give the same logits and pool with the fusion on and off.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (float32 and float16:
the interpreter's bfloat16 dot is wrong, see sglang.test.triton_interpreter); on a GPU in
bfloat16 too. Bit for bit holds under the interpreter in every dtype and compiled in bfloat16,
whose rounding of each product is done on the bits (rmsnorm.round_to). Compiled in float32 and
float16 the two kernels contract their products into FMAs differently (the H200, twenty-sixth
session: 1 ulp, in the second half of the rotated channels only), so there the rotated keys
must agree within 2 ulps of the dtype and the attention outputs within 16.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    alloc_decode_partials,
    decode_attention_fwd,
)
from sglang.srt.layers.attention.triton_ops.decode_grouped import DecodeRope  # noqa: E402
from sglang.srt.layers.triton_kernels.rope_kv import rope_and_store_kv  # noqa: E402
from sglang.test.tiny_llama_steps import ragged_prefill_then_decode  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def _cos_sin(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(DEVICE)


def _case(dtype, seq_lens, hq, hkv, d=64, seed=0):
    """A decode step: bs requests whose last token (position seq_len - 1) is new, its slot
    already in req_to_token, the cache holding the earlier tokens; qkv rows as the layer has
    them (q, k, v views of one [bs, (hq + 2 hkv) d] tensor)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    width = max(seq_lens) + 4
    slots = bs * width + 1
    perm = torch.randperm(slots - 1, generator=g)[: bs * width] + 1  # slot 0 unused
    r2t = perm.view(bs, width).to(torch.int32)
    cache_k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    cache_v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    loc = r2t[torch.arange(bs), lens - 1].to(torch.int64)
    pos = lens - 1 + torch.tensor([0, 3, 7, 1][:bs], dtype=torch.int64)  # any positions
    return {
        "qkv": qkv.to(DEVICE),
        "k_cache": cache_k.to(DEVICE),
        "v_cache": cache_v.to(DEVICE),
        "r2t": r2t.to(DEVICE),
        "rows": torch.arange(bs, dtype=torch.int64, device=DEVICE),
        "seq_lens": lens.to(DEVICE),
        "loc": loc.to(DEVICE),
        "pos": pos.to(DEVICE),
        "cos_sin": _cos_sin(int(pos.max()) + 8, d),
        "hq": hq,
        "hkv": hkv,
        "d": d,
    }


def _run(c, fused: bool, splits: int):
    qkv = c["qkv"].clone()
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    hq, hkv, d = c["hq"], c["hkv"], c["d"]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    rope = None
    if fused:
        rope = DecodeRope(c["pos"], c["cos_sin"], k, v, c["loc"])
    else:
        q, k = rope_and_store_kv(c["pos"], q, k, v, c["cos_sin"], d, d, k_cache, v_cache, c["loc"])
    bs = qkv.shape[0]
    out = torch.empty(bs, hq, d, dtype=qkv.dtype, device=DEVICE)
    partials = alloc_decode_partials(bs, hq, d, splits, DEVICE) if splits > 1 else None
    decode_attention_fwd(
        q.reshape(bs, hq, d), k_cache, v_cache, out, c["r2t"], c["rows"], c["seq_lens"],
        d**-0.5, num_splits=splits, partials=partials, grouped=True, rope=rope,
    )  # fmt: skip
    return out, k_cache, v_cache


def _assert_same(x: torch.Tensor, y: torch.Tensor, ulps: int = 2) -> None:
    """Bit for bit where both kernels round the same way (see the module docstring), else
    within `ulps` ulps of the dtype (relative; absolute 2 ulps of 1)."""
    if not HAS_CUDA or x.dtype == torch.bfloat16:
        assert torch.equal(x, y)
        return
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(x, y, rtol=ulps * eps, atol=2 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("splits", [1, 4])
def test_fused_equals_rope_kv_then_decode(dtype, hq, hkv, splits):
    c = _case(dtype, [1, 37, 70, 5], hq, hkv)
    out_f, k_f, v_f = _run(c, True, splits)
    out_u, k_u, v_u = _run(c, False, splits)
    assert torch.isfinite(out_u.float()).all()
    _assert_same(k_f, k_u)
    assert torch.equal(v_f, v_u)
    # the attention output carries the rotated query's and key's ulps through the softmax
    # (float32 on the H200: 1.2e-6 relative at one element of 2048)
    _assert_same(out_f, out_u, ulps=16)
    # the new K / V rows did change: the fusion stored them
    assert not torch.equal(k_f[c["loc"]], c["k_cache"][c["loc"]])


@pytest.mark.parametrize("splits", [1, 4])
def test_fused_never_reads_the_new_tokens_cache_entry(splits):
    """The kernel attends with the new key and value it rotated, never with the cache at
    position seq_len - 1: on a GPU another program of the same launch may store that entry
    only while it is read. Pointing req_to_token[row, seq_len - 1] at a NaN slot (the new token
    still goes to loc) leaves the fused output unchanged, bit for bit (and equal to the unfused
    path's, see _assert_same)."""
    c = _case(torch.float32, [1, 37, 70, 5], 8, 2)
    out_ref, _, _ = _run(c, True, splits)
    _assert_same(out_ref, _run(c, False, splits)[0], ulps=16)
    nan_slot = c["k_cache"].shape[0]
    c["k_cache"] = torch.cat([c["k_cache"], torch.full_like(c["k_cache"][:1], float("nan"))])
    c["v_cache"] = torch.cat([c["v_cache"], torch.full_like(c["v_cache"][:1], float("nan"))])
    c["r2t"][c["rows"], c["seq_lens"] - 1] = nan_slot
    out, k_cache, _ = _run(c, True, splits)
    assert torch.equal(out, out_ref)
    assert torch.isnan(k_cache[nan_slot]).all()  # still never written


def test_rope_needs_grouped_and_fitting_tensors():
    c = _case(torch.float32, [3, 9], 4, 2)
    hq, hkv, d = c["hq"], c["hkv"], c["d"]
    q, k, v = c["qkv"].split([hq * d, hkv * d, hkv * d], dim=-1)
    out = torch.empty(2, hq, d, device=DEVICE)
    args = (q.reshape(2, hq, d), c["k_cache"], c["v_cache"], out, c["r2t"], c["rows"])
    good = DecodeRope(c["pos"], c["cos_sin"], k, v, c["loc"])
    with pytest.raises(ValueError, match="needs grouped=True"):
        decode_attention_fwd(*args, c["seq_lens"], 0.1, rope=good)
    bad = DecodeRope(c["pos"][:1], c["cos_sin"], k, v, c["loc"])
    with pytest.raises(ValueError, match="positions"):
        decode_attention_fwd(*args, c["seq_lens"], 0.1, grouped=True, rope=bad)
    bad = DecodeRope(c["pos"], c["cos_sin"][:, :16], k, v, c["loc"])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        decode_attention_fwd(*args, c["seq_lens"], 0.1, grouped=True, rope=bad)


def _prefill_then_decode(model_dir: str, dtype: str, backend_cls) -> tuple[list, list]:
    """ragged_prefill_then_decode with two decode steps: each step's logits, the KV pool's k
    and v buffers."""
    return ragged_prefill_then_decode(model_dir, backend_cls, dtype, DEVICE, decode_steps=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_decode_fused_equals_unfused(tiny_model_dir, monkeypatch, dtype) -> None:
    """Decode steps with the RoPE and KV store inside the decode kernel give the logits and the
    KV pool of the default path (rope_kv.py's kernel, then the decode kernel) bit for bit (on a
    GPU in float32: within 1e-5, the kernels' FMAs differ, see the module docstring); the
    prefill keeps rope_kv.py's kernel. (bf16 under the interpreter: both paths run the same
    wrong bf16 dots, so they still must agree.)"""
    from sglang.srt.layers import fused_rope_kv, rotary_embedding
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache import memory_pool

    monkeypatch.setattr(rotary_embedding, "use_triton_kernels", lambda t, *more: True)
    monkeypatch.setattr(memory_pool, "use_triton_kernels", lambda t, *more: True)
    monkeypatch.setattr(fused_rope_kv, "use_fused_rope_kv", lambda t: True)
    ropes: list[bool] = []
    forward = TritonAttnBackend.forward

    def counting(self, *args, rope=None, **kw):
        ropes.append(rope is not None)
        return forward(self, *args, rope=rope, **kw) if rope else forward(self, *args, **kw)

    monkeypatch.setattr(TritonAttnBackend, "forward", counting)
    monkeypatch.setattr(fused_rope_kv, "use_fused_rope_decode", lambda t: True)
    fused_logits, fused_kv = _prefill_then_decode(tiny_model_dir, dtype, TritonAttnBackend)
    assert ropes == [False] * 2 + [True] * 4  # 2 layers: the prefill, then both decode steps
    monkeypatch.setattr(fused_rope_kv, "use_fused_rope_decode", lambda t: False)
    logits, kv = _prefill_then_decode(tiny_model_dir, dtype, TritonAttnBackend)
    assert ropes == [False] * 2 + [True] * 4 + [False] * 6
    for x, y in zip(fused_logits + fused_kv, logits + kv, strict=True):
        if HAS_CUDA and dtype == "float32":
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(x, y)
    # 11 tokens: slots 6-16 of every layer's k and v written, nothing else
    assert all(x.flatten(1).any(1).nonzero().flatten().tolist() == [*range(6, 17)] for x in kv)


def test_per_head_decode_and_other_backends_stay_unfused(tiny_model_dir, monkeypatch) -> None:
    """Only the grouped decode kernel takes the RoPE: with SGLANG_TRITON_DECODE_GROUPED=0's
    per-head kernels (and torch_native, which has no fuses_decode_rope) decode_rope declines."""
    from sglang.srt.layers import fused_rope_kv
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert TritonAttnBackend().fuses_decode_rope
    assert not TritonAttnBackend(grouped_decode=False).fuses_decode_rope
    assert not getattr(TorchNativeAttnBackend(), "fuses_decode_rope", False)
    monkeypatch.setattr(fused_rope_kv, "use_fused_rope_decode", lambda t: True)
    per_head = lambda: TritonAttnBackend(grouped_decode=False)  # noqa: E731
    logits, _ = _prefill_then_decode(tiny_model_dir, "float32", per_head)
    ref, _ = _prefill_then_decode(tiny_model_dir, "float32", TorchNativeAttnBackend)
    for x, y in zip(logits, ref, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_switch(monkeypatch):
    from sglang.srt.layers import triton_kernels

    for value, on in (("", True), ("0", False), ("1", True), ("on", True), ("off", False)):
        monkeypatch.setenv("SGLANG_FUSED_ROPE_DECODE", value)
        assert triton_kernels._fused_rope_decode_enabled() is on
    monkeypatch.setenv("SGLANG_FUSED_ROPE_DECODE", "sometimes")
    with pytest.raises(ValueError, match="SGLANG_FUSED_ROPE_DECODE='sometimes'"):
        triton_kernels._fused_rope_decode_enabled()


def test_drafts_keep_rope_out_of_the_decode_kernel(tiny_model_dir, tmp_path) -> None:
    """The target's attention layers may hand decode RoPE to the kernel; the EAGLE and EAGLE-3
    drafts' layers may not (their drafting steps' slots need not sit at req_to_token[row,
    seq_len - 1])."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model
    from sglang.srt.models.llama import LlamaAttention
    from sglang.srt.speculative.draft_config import load_draft_model
    from sglang.test.tiny_eagle import make_tiny_eagle_dir
    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

    cfg = ModelConfig(tiny_model_dir, dtype="float32")
    target = get_model(cfg, device=DEVICE)

    def flags(model) -> list[bool]:
        return [m.rope_in_decode for m in model.modules() if isinstance(m, LlamaAttention)]

    assert flags(target) == [True, True]
    for make, name in ((make_tiny_eagle3_dir, "eagle3"), (make_tiny_eagle_dir, "eagle")):
        draft_dir = make(str(tmp_path / name), tiny_model_dir)
        draft = load_draft_model(draft_dir, target, cfg, DEVICE, torch.float32)
        assert flags(draft) and not any(flags(draft)), name
