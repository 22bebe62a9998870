"""torch_native attention: the padded batched path and the per-request fallback both equal the
single-request reference on ragged batches with cached prefixes and GQA."""

from __future__ import annotations

import random

import pytest
import torch

import sglang.srt.layers.attention.torch_native_backend as tnb
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    build_positions_and_starts,
)


def ragged_case(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    h, hkv, d = 6, 2, 16
    bs = rng.randrange(1, 6)
    prefix = [rng.randrange(0, 20) for _ in range(bs)]
    ext = [rng.randrange(1, 12) for _ in range(bs)]
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    pool = MHATokenToKVPool(512, torch.float32, hkv, d, 1, "cpu")
    r2t = ReqToTokenPool(8, 64, "cpu")
    perm = torch.randperm(511) + 1
    used = 0
    out_loc = []
    for i in range(bs):
        slots = perm[used : used + seq[i]]
        used += seq[i]
        r2t.write(i, 0, slots)
        pool.k_buffer[0][slots[: prefix[i]]] = torch.randn(prefix[i], hkv, d)
        pool.v_buffer[0][slots[: prefix[i]]] = torch.randn(prefix[i], hkv, d)
        out_loc.append(slots[prefix[i] :])
    pos, starts = build_positions_and_starts(prefix, ext, "cpu")
    t = sum(ext)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=pos,
        out_cache_loc=torch.cat(out_loc),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.tensor(seq),
        extend_seq_lens=torch.tensor(ext),
        extend_prefix_lens=torch.tensor(prefix),
        extend_start_loc=starts,
        seq_lens_cpu=seq,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=prefix,
        logits_indices=starts,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
    )
    layer = RadixAttention(h, d, d**-0.5, hkv, 0)
    q, k, v = torch.randn(t, h * d), torch.randn(t, hkv * d), torch.randn(t, hkv * d)
    expected = []
    kk, vv = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    kk[fb.out_cache_loc], vv[fb.out_cache_loc] = k.view(t, hkv, d), v.view(t, hkv, d)
    s = 0
    for i in range(bs):
        slots = r2t.req_to_token[i, : seq[i]].long()
        qi = q[s : s + ext[i]].view(-1, h, d)
        expected.append(tnb.attention_reference(qi, kk[slots], vv[slots], d**-0.5, prefix[i]))
        s += ext[i]
    return fb, layer, (q, k, v), torch.cat(expected).reshape(t, h * d)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("padded", [True, False])
def test_backend_matches_reference(seed, padded, monkeypatch):
    if not padded:
        monkeypatch.setattr(tnb, "MAX_PADDED_SCORES", 0)
    fb, layer, (q, k, v), expected = ragged_case(seed)
    backend = tnb.TorchNativeAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    assert isinstance(fb.attn_metadata, tnb.PaddedMetadata) == padded
    out = layer(q, k, v, fb)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_build_forward_batch_metadata_equals_the_per_vector_reference():
    """ModelRunner.build_forward_batch (numpy metadata, one packed int64_to_device) equals the
    per-vector construction it replaced on random ragged batches: positions, start offsets,
    logits rows (including requests with no logits rows, and zero-length requests), int64
    ids / KV slots from int32 or strided host tensors, and the caller's tensors are never
    written."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ModelWorkerBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = SimpleNamespace(
        device=torch.device("cpu"), req_to_token_pool=None, token_to_kv_pool=None, attn_backend=None
    )
    rng = random.Random(0)
    for case in range(300):
        bs = rng.randrange(0, 7)
        prefix = [rng.randrange(0, 50) for _ in range(bs)]
        ext = [rng.choice([0, 1, 1, 3, 17]) for _ in range(bs)]
        rows = [rng.randrange(0, e + 1) for e in ext]
        t = sum(ext)
        ids = torch.randint(0, 30000, (2 * t,), dtype=torch.int64)[::2]  # strided
        loc = torch.randint(1, 1 << 30, (t,), dtype=torch.int64)
        if case % 3 == 1:
            ids, loc = ids.to(torch.int32), loc.to(torch.int32)
        ids_before, loc_before = ids.clone(), loc.clone()
        mwb = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=ids,
            out_cache_loc=loc,
            req_pool_indices=[rng.randrange(0, 64) for _ in range(bs)],
            seq_lens=[p + e for p, e in zip(prefix, ext, strict=True)],
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            num_logit_rows=rows,
            sample=[r > 0 for r in rows],
            input_logprob_targets=[[] for _ in range(bs)],
            sampling_info=None,
        )
        fb = ModelRunner.build_forward_batch(runner, mwb)
        pos_ref, starts_ref, logit_ref = [], [], []
        off = 0
        for p, e, r in zip(prefix, ext, rows, strict=True):
            starts_ref.append(off)
            pos_ref.extend(range(p, p + e))
            logit_ref.extend(range(off + e - r, off + e))
            off += e
        got = {
            "positions": fb.positions,
            "extend_start_loc": fb.extend_start_loc,
            "logits_indices": fb.logits_indices,
            "req_pool_indices": fb.req_pool_indices,
            "seq_lens": fb.seq_lens,
            "extend_seq_lens": fb.extend_seq_lens,
            "extend_prefix_lens": fb.extend_prefix_lens,
            "input_ids": fb.input_ids,
            "out_cache_loc": fb.out_cache_loc,
        }
        want = {
            "positions": pos_ref,
            "extend_start_loc": starts_ref,
            "logits_indices": logit_ref,
            "req_pool_indices": mwb.req_pool_indices,
            "seq_lens": mwb.seq_lens,
            "extend_seq_lens": ext,
            "extend_prefix_lens": prefix,
            "input_ids": ids_before.tolist(),
            "out_cache_loc": loc_before.tolist(),
        }
        for k, v in got.items():
            assert v.dtype == torch.int64 and v.dim() == 1, k
            assert v.tolist() == want[k], (case, k)
        assert (fb.seq_lens_cpu, fb.extend_seq_lens_cpu) == (mwb.seq_lens, ext)
        assert fb.extend_prefix_lens_cpu == prefix and fb.batch_size == bs
        assert torch.equal(ids, ids_before) and torch.equal(loc, loc_before)
