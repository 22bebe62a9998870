"""triton attention backend: decode and ragged causal extend kernels equal
torch_native_backend.attention_reference (CPU via the Triton interpreter), and the engine gives
the same greedy outputs with --attention-backend triton as with torch_native."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET

triton = pytest.importorskip("triton")

from sglang.srt.layers.attention import create_attention_backend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import (  # noqa: E402
    TorchNativeAttnBackend,
    attention_reference,
)
from sglang.srt.layers.attention.triton_backend import (  # noqa: E402
    DECODE_SPLITS,
    TritonAttnBackend,
)
from sglang.srt.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    alloc_decode_partials,
    decode_attention_fwd,
)
from sglang.srt.layers.attention.triton_ops.decode_grouped import MAX_SPLITS  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
    build_positions_and_starts,
)

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# The float32 tests run on DEVICE, where the kernels run: CUDA when present, else the interpreter.


def make_case(
    seed: int,
    decode: bool,
    h: int = 6,
    hkv: int = 2,
    d: int = 64,
    max_bs: int = 5,
    max_prefix: int = 20,
    max_ext: int = 12,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    prefix: list[int] | None = None,
):
    """A random ragged batch over a shuffled paged pool; returns (fb, layer, (q, k, v), expected)
    with expected [num_tokens, h * d] from attention_reference per request in float32.
    prefix: fixed cached lengths (one per request) instead of random ones."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    if prefix is None:
        bs = rng.randrange(1, max_bs + 1)
        prefix = [rng.randrange(0, max_prefix + 1) for _ in range(bs)]
    bs = len(prefix)
    ext = [1 if decode else rng.randrange(1, max_ext + 1) for _ in range(bs)]
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    size = sum(seq) + 8
    pool = MHATokenToKVPool(size, dtype, hkv, d, 1, device)
    r2t = ReqToTokenPool(bs + 3, max(seq) + 5, device)
    rows = rng.sample(range(bs + 3), bs)  # requests live in scattered req_to_token rows
    perm = torch.randperm(size) + 1
    used, out_loc = 0, []
    for i in range(bs):
        slots = perm[used : used + seq[i]].to(device)
        used += seq[i]
        r2t.write(rows[i], 0, slots)
        pool.k_buffer[0][slots[: prefix[i]]] = torch.randn(prefix[i], hkv, d, device=device).to(
            dtype
        )
        pool.v_buffer[0][slots[: prefix[i]]] = torch.randn(prefix[i], hkv, d, device=device).to(
            dtype
        )
        out_loc.append(slots[prefix[i] :])
    pos, starts = build_positions_and_starts(prefix, ext, device)
    t = sum(ext)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=pos,
        out_cache_loc=torch.cat(out_loc),
        req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(seq, device=device),
        extend_seq_lens=torch.tensor(ext, device=device),
        extend_prefix_lens=torch.tensor(prefix, device=device),
        extend_start_loc=starts,
        seq_lens_cpu=seq,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=prefix,
        logits_indices=starts,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
    )
    layer = RadixAttention(h, d, d**-0.5, hkv, 0)
    q = torch.randn(t, h * d, device=device).to(dtype)
    k = torch.randn(t, hkv * d, device=device).to(dtype)
    v = torch.randn(t, hkv * d, device=device).to(dtype)
    kk, vv = pool.k_buffer[0].float().clone(), pool.v_buffer[0].float().clone()
    kk[fb.out_cache_loc] = k.view(t, hkv, d).float()
    vv[fb.out_cache_loc] = v.view(t, hkv, d).float()
    expected, s = [], 0
    for i in range(bs):
        slots = r2t.req_to_token[rows[i], : seq[i]].long()
        qi = q[s : s + ext[i]].view(-1, h, d).float()
        expected.append(attention_reference(qi, kk[slots], vv[slots], d**-0.5, prefix[i]))
        s += ext[i]
    return fb, layer, (q, k, v), torch.cat(expected).reshape(t, h * d)


def run_backend(fb, layer, qkv, decode_num_splits=None):
    backend = TritonAttnBackend(decode_num_splits=decode_num_splits)
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    assert fb.attn_metadata.is_decode == fb.forward_mode.is_decode()
    return layer(*qkv, fb)


@pytest.mark.parametrize("seed", range(6))
def test_extend_matches_reference(seed):
    fb, layer, qkv, expected = make_case(seed, decode=False, device=DEVICE)
    out = run_backend(fb, layer, qkv)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_decode_matches_reference(seed):
    fb, layer, qkv, expected = make_case(seed, decode=True, device=DEVICE)
    out = run_backend(fb, layer, qkv)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_extend_kernel_on_decode_batch_matches_decode_kernel():
    # A one-token-per-request EXTEND step goes through the extend kernel; same answer.
    fb, layer, qkv, expected = make_case(11, decode=True, device=DEVICE)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    backend = TritonAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    fb.attn_metadata.is_decode = False
    torch.testing.assert_close(layer(*qkv, fb), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed,splits", [(0, None), (1, None), (2, 3), (3, 1), (4, 4), (5, None)])
def test_verify_as_decode_matches_reference(seed, splits):
    """SGLANG_TRITON_VERIFY_DECODE: a target verify's token rows attended as grouped decodes
    of their own positions (ExtendRows) equal the causal extend reference, with and without
    split-K (forced splits exercise the merge over partly empty splits)."""
    fb, layer, qkv, expected = make_case(seed, decode=False, max_ext=8, device=DEVICE)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    backend = TritonAttnBackend(decode_num_splits=splits, verify_as_decode=True)
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    assert fb.attn_metadata.extend_as_decode and not fb.attn_metadata.is_decode
    torch.testing.assert_close(layer(*qkv, fb), expected, atol=1e-4, rtol=1e-4)


def test_verify_as_decode_only_where_it_applies(monkeypatch):
    """On by default (SGLANG_TRITON_VERIFY_DECODE=0 turns it off); only target verify steps of
    at most VERIFY_DECODE_MAX_BS requests and VERIFY_DECODE_MAX_EXTEND tokens each, and only
    with the grouped kernel; a prefill extend keeps the extend kernel."""
    from sglang.srt.layers.attention.triton_backend import (
        VERIFY_DECODE_MAX_BS,
        VERIFY_DECODE_MAX_EXTEND,
    )

    monkeypatch.setenv("SGLANG_TRITON_VERIFY_DECODE", "0")
    assert not TritonAttnBackend().verify_as_decode
    monkeypatch.delenv("SGLANG_TRITON_VERIFY_DECODE", raising=False)
    assert TritonAttnBackend().verify_as_decode
    assert not TritonAttnBackend(grouped_decode=False).verify_as_decode
    backend = TritonAttnBackend()
    fb, *_ = make_case(7, decode=False, max_ext=VERIFY_DECODE_MAX_EXTEND, device=DEVICE)
    backend.init_forward_metadata(fb)
    assert not fb.attn_metadata.extend_as_decode  # EXTEND: a prefill
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    backend.init_forward_metadata(fb)
    assert fb.attn_metadata.extend_as_decode
    fb.extend_seq_lens_cpu = [VERIFY_DECODE_MAX_EXTEND + 1] * fb.batch_size
    backend.init_forward_metadata(fb)
    assert not fb.attn_metadata.extend_as_decode
    fb.extend_seq_lens_cpu = [2] * fb.batch_size
    fb.batch_size = VERIFY_DECODE_MAX_BS + 1
    backend.init_forward_metadata(fb)
    assert not fb.attn_metadata.extend_as_decode


def test_verify_as_decode_padding_rows_stay_finite():
    """CUDA-graph token padding after the last request's tokens: the real rows equal the
    reference and the padding rows (attending the last request's whole length) are finite."""
    fb, layer, (q, k, v), expected = make_case(9, decode=False, max_ext=6, device=DEVICE)
    t, pad = q.shape[0], 3
    z = torch.zeros(pad, dtype=torch.int64, device=DEVICE)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    fb.input_ids = torch.cat([fb.input_ids, z])
    fb.positions = torch.cat([fb.positions, z])
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, z])  # the padding slot 0
    qkv = [torch.cat([x, torch.randn(pad, x.shape[1], device=DEVICE)]) for x in (q, k, v)]
    backend = TritonAttnBackend(verify_as_decode=True)
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    assert fb.attn_metadata.extend_as_decode
    out = layer(*qkv, fb)
    torch.testing.assert_close(out[:t].float(), expected, atol=2e-4, rtol=2e-4)
    assert torch.isfinite(out[t:]).all()


def test_extend_rows_refused_with_rope_or_per_head_kernel():
    from sglang.srt.layers.attention.triton_ops.decode_grouped import ExtendRows

    q = torch.zeros(2, 4, 16, device=DEVICE)
    kv = torch.zeros(8, 2, 16, device=DEVICE)
    idx = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    r2t = torch.zeros(1, 8, dtype=torch.int32, device=DEVICE)
    rows = ExtendRows(idx, idx)
    with pytest.raises(ValueError, match="needs grouped=True"):
        decode_attention_fwd(q, kv, kv, q.clone(), r2t, idx, idx + 2, 1.0, rows=rows)


def test_one_query_per_request_with_unassigned_rows_is_not_decode():
    """A padded static batch with one query per request but more token rows than requests
    (the chain drafting graph's catch-up of b * (K + 1) rows, run eagerly, when every
    catch-up is one token): the metadata is not decode (the decode kernel runs one program
    per row and would index requests past the batch with the extra rows), the real rows equal
    the reference and the unassigned rows stay zero."""
    fb, layer, (q, k, v), expected = make_case(3, decode=True, device=DEVICE)
    t, pad = q.shape[0], 5
    z = torch.zeros(pad, dtype=torch.int64, device=DEVICE)
    fb.input_ids = torch.cat([fb.input_ids, z])
    fb.positions = torch.cat([fb.positions, z])
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, z])  # the padding slot 0
    qkv = [torch.cat([x, torch.randn(pad, x.shape[1], device=DEVICE)]) for x in (q, k, v)]
    backend = TritonAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    assert fb.num_tokens == t + pad and not fb.attn_metadata.is_decode
    out = layer(*qkv, fb)
    torch.testing.assert_close(out[:t].float(), expected, atol=2e-4, rtol=2e-4)
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))


def test_bad_head_dim_and_cpu_without_interpreter_refused(monkeypatch):
    fb, _, (q, k, v), _ = make_case(0, decode=True, d=64, device=DEVICE)
    layer = RadixAttention(6, 48, 48**-0.5, 2, 0)
    backend = TritonAttnBackend()
    backend.init_forward_metadata(fb)
    fb.attn_backend = backend
    with pytest.raises(ValueError, match="power of two"):
        backend.forward(
            q[:, : 6 * 48], k[:, :96].view(-1, 2, 48), v[:, :96].view(-1, 2, 48), layer, fb
        )

    class CpuRunner:
        device = torch.device("cpu")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        create_attention_backend("triton", CpuRunner())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_bf16_matches_reference(seed, decode, d):
    fb, layer, qkv, expected = make_case(
        seed,
        decode,
        h=32,
        hkv=8,
        d=d,
        max_bs=32,
        max_prefix=700,
        max_ext=300,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out = run_backend(fb, layer, qkv)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


# Split-K decode. KV lengths 1, 7, 64, 1000, 3000 (decode token included): with 8 splits the
# short requests leave most splits empty while the long ones fill all of them.
SPLIT_PREFIX = [0, 6, 63, 999, 2999]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("hkv", [3, 1])  # GQA group 1 and 3
def test_split_decode_matches_reference(num_splits, hkv):
    fb, layer, qkv, expected = make_case(
        num_splits, decode=True, h=3, hkv=hkv, d=16, prefix=SPLIT_PREFIX, device=DEVICE
    )
    out = run_backend(fb, layer, qkv, decode_num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # one scratch per forward (shared by the layers), none for the single-stage kernel
    want = {(3, 16, num_splits)} if num_splits > 1 else set()
    assert set(fb.attn_metadata.decode_partials) == want


@pytest.mark.parametrize("grouped", [False, True])
def test_split_decode_writes_every_split(grouped):
    # Scratch starts as NaN, so a split the kernel skipped would poison the output. KV lengths
    # 7, 200, 1 with BLOCK_N 16 and 3 splits: chunks of 16, 80 (3 full splits), 16 tokens.
    h, hkv, d = 2, 1, 16
    fb, layer, (q, k, v), expected = make_case(
        21, decode=True, h=h, hkv=hkv, d=d, prefix=[6, 199, 0], device=DEVICE
    )
    pool, r2t = fb.token_to_kv_pool, fb.req_to_token_pool.req_to_token
    pool.set_kv_buffer(0, fb.out_cache_loc, k.view(-1, hkv, d), v.view(-1, hkv, d))
    mid_o, mid_ml = alloc_decode_partials(3, h, d, 3, DEVICE)
    mid_o.fill_(float("nan"))
    mid_ml.fill_(float("nan"))
    out = torch.zeros(3, h, d, device=DEVICE)
    args = (q.view(3, h, d), pool.k_buffer[0], pool.v_buffer[0], out, r2t)
    args += (fb.req_pool_indices, fb.seq_lens, d**-0.5)
    decode_attention_fwd(*args, block_n=16, num_splits=3, partials=(mid_o, mid_ml), grouped=grouped)
    torch.testing.assert_close(out.view(3, h * d), expected, atol=1e-4, rtol=1e-4)
    empty = torch.tensor([[0, 1, 1], [0, 0, 0], [0, 1, 1]], dtype=torch.bool, device=DEVICE)
    empty = empty[:, None, :].expand(3, h, 3)
    assert torch.all(mid_ml[..., 0][empty] == float("-inf"))
    assert torch.all(mid_ml[..., 1][empty] == 0) and torch.all(mid_o[empty] == 0)
    assert torch.all(mid_ml[..., 1][~empty] >= 1)  # the max term alone contributes exp(0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention_fwd(*args, num_splits=0)
    with pytest.raises(ValueError, match="partials"):
        decode_attention_fwd(*args, num_splits=2, partials=(mid_o, mid_ml))


def test_decode_num_splits_rule():
    backend = TritonAttnBackend(grouped_decode=False)
    backend.num_sms = 132  # H200
    assert DECODE_SPLITS == 8
    assert backend.decode_num_splits(1, 32, 8200) == 8
    assert backend.decode_num_splits(8, 32, 8200) == 8  # 256 programs < 2 * 132 SMs
    assert backend.decode_num_splits(9, 32, 8200) == 1  # 288 programs fill the GPU already
    assert backend.decode_num_splits(1, 32, 2048) == 8
    assert backend.decode_num_splits(1, 32, 2047) == 1  # short contexts: one pass is enough
    backend.num_sms = None  # not on CUDA
    assert backend.decode_num_splits(1, 32, 8200) == 1
    assert TritonAttnBackend(decode_num_splits=3).decode_num_splits(256, 64, 16) == 3


def test_grouped_decode_num_splits_rule(monkeypatch):
    backend = TritonAttnBackend()  # grouped by default
    assert backend.grouped_decode
    backend.num_sms = 132  # H200: 264 programs wanted
    assert MAX_SPLITS == 32
    assert backend.decode_num_splits(1, 32, 16, num_kv_heads=8) == 32  # 8B heads, batch 1
    assert backend.decode_num_splits(4, 32, 16, num_kv_heads=8) == 8  # 264 // 32
    assert backend.decode_num_splits(16, 32, 16, num_kv_heads=8) == 2
    assert backend.decode_num_splits(33, 32, 16, num_kv_heads=8) == 1  # 264 programs already
    assert backend.decode_num_splits(1, 9, 16, num_kv_heads=3) == 32  # SmolLM2: 264 // 3 capped
    assert backend.decode_num_splits(8, 9, 16, num_kv_heads=3) == 11
    with pytest.raises(ValueError, match="num_kv_heads"):
        backend.decode_num_splits(1, 32, 16)
    backend.num_sms = None  # not on CUDA
    assert backend.decode_num_splits(1, 32, 16, num_kv_heads=8) == 1
    monkeypatch.setenv("SGLANG_TRITON_DECODE_GROUPED", "0")
    assert not TritonAttnBackend().grouped_decode


# GQA groups 1, 3, 4, 8 (BLOCK_H 16) and 32 (BLOCK_H 32); one pass and split-K.
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("h,hkv", [(2, 2), (6, 2), (8, 2), (16, 2), (32, 1)])
def test_grouped_decode_equals_per_head_decode(h, hkv, num_splits):
    fb, layer, (q, k, v), expected = make_case(
        30 + h, decode=True, h=h, hkv=hkv, d=16, prefix=[0, 40, 129, 7], device=DEVICE
    )
    pool, r2t = fb.token_to_kv_pool, fb.req_to_token_pool.req_to_token
    pool.set_kv_buffer(0, fb.out_cache_loc, k.view(-1, hkv, 16), v.view(-1, hkv, 16))
    outs = {}
    for grouped in (False, True):
        out = torch.full((4, h, 16), float("nan"), device=DEVICE)
        args = (q.view(4, h, 16), pool.k_buffer[0], pool.v_buffer[0], out, r2t)
        args += (fb.req_pool_indices, fb.seq_lens, 16**-0.5)
        decode_attention_fwd(*args, num_splits=num_splits, grouped=grouped)
        outs[grouped] = out.view(4, h * 16)
        torch.testing.assert_close(outs[grouped], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("d,h,hkv", [(64, 32, 8), (128, 32, 8), (64, 9, 3)])
def test_cuda_bf16_split_decode_matches_reference(d, h, hkv, grouped, monkeypatch):
    # 8B heads at head_dim 64 and 128, and SmolLM2's (9 query heads over 3 KV heads)
    monkeypatch.setenv("SGLANG_TRITON_DECODE_GROUPED", str(int(grouped)))
    prefix = [3999, 0, 1499, 3999, 300]  # KV lengths 4000, 1, 1500, 4000, 301
    case = dict(decode=True, h=h, hkv=hkv, d=d, dtype=torch.bfloat16, device="cuda")
    fb, layer, qkv, expected = make_case(5, prefix=prefix, **case)
    backend = TritonAttnBackend()
    width = fb.req_to_token_pool.req_to_token.shape[1]
    if backend.num_sms >= 64 and not grouped:  # split-K for this shape (5 * 32 < 2 * SMs)
        assert backend.decode_num_splits(5, h, width) == 8
    if grouped:  # the rule's own count: 2 * SMs // (5 * hkv) programs, up to 32
        assert backend.decode_num_splits(5, h, width, hkv) > 1
    out = run_backend(fb, layer, qkv)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    fb, layer, qkv, _ = make_case(5, prefix=prefix, **case)
    single = run_backend(fb, layer, qkv, decode_num_splits=1)
    torch.testing.assert_close(out.float(), single.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("grouped,splits", [(False, 8), (True, 8), (True, 32)])
def test_cuda_graph_split_decode_replays_new_lengths(grouped, splits):
    # Captured once with 8 (32) splits; replays with other KV lengths (other split boundaries,
    # more empty splits) read the same persistent metadata and scratch.
    h, hkv, d = 32, 8, 128
    fb, layer, (q, k, v), expected = make_case(
        6, True, h=h, hkv=hkv, d=d, dtype=torch.bfloat16, device="cuda", prefix=[3999, 9, 2047]
    )
    backend = TritonAttnBackend(decode_num_splits=splits, grouped_decode=grouped)
    fb.attn_backend = backend
    backend.init_forward_metadata_capture_cuda_graph(fb, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(q, k, v, fb)  # warm-up: compiles, allocates the split scratch
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    scratch = dict(fb.attn_metadata.decode_partials)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = layer(q, k, v, fb)
    # nothing allocated while capturing: the graph reads the warm-up's scratch
    assert len(scratch) == 1 and fb.attn_metadata.decode_partials.keys() == scratch.keys()
    assert all(fb.attn_metadata.decode_partials[key] is t for key, t in scratch.items())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    new_seq = [1, 5, 1000]
    fb.seq_lens.copy_(torch.tensor(new_seq))
    graph.replay()
    torch.cuda.synchronize()
    pool, r2t = fb.token_to_kv_pool, fb.req_to_token_pool.req_to_token
    kk, vv = pool.k_buffer[0].float(), pool.v_buffer[0].float()
    for i, n in enumerate(new_seq):
        slots = r2t[int(fb.req_pool_indices[i]), :n].long()
        qi = q.view(-1, h, d)[i : i + 1].float()
        want = attention_reference(qi, kk[slots], vv[slots], d**-0.5, n - 1)
        torch.testing.assert_close(out[i].float(), want.reshape(-1), atol=2e-2, rtol=2e-2)


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400, 500, 600, 700], [42]]


def greedy_outputs(model_dir: str, backend: str, max_new_tokens: int) -> dict[str, list[int]]:
    from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

    # float32: bf16 rounding differs between kernels, so only float32 greedy runs are equal
    sched = make_scheduler(model_dir, attention_backend=backend, device="auto", dtype="float32")
    want_cls = TritonAttnBackend if backend == "triton" else TorchNativeAttnBackend
    assert type(sched.tp_worker.model_runner.attn_backend) is want_cls
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    for i, ids in enumerate(PROMPTS):
        submit(sched, f"r{i}", ids, params)
    outputs: dict[str, dict] = {}
    run_until_idle(sched, outputs)
    return {rid: o["output_ids"] for rid, o in outputs.items()}


def test_engine_greedy_matches_torch_native(tiny_model_dir, monkeypatch):
    import sglang.srt.layers.attention.triton_backend as tb

    calls = {"decode": 0, "extend": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(tb, "decode_attention_fwd", counted("decode", tb.decode_attention_fwd))
    monkeypatch.setattr(tb, "extend_attention_fwd", counted("extend", tb.extend_attention_fwd))
    n = 16 if HAS_CUDA else 4
    got = greedy_outputs(tiny_model_dir, "triton", n)
    assert calls["decode"] > 0 and calls["extend"] > 0  # both kernels ran in the engine
    want = greedy_outputs(tiny_model_dir, "torch_native", n)
    assert sorted(got) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(len(ids) == n for ids in got.values())
    assert got == want


@gpu
def test_extend_kernel_compiles_once_for_any_index_offset():
    """The per-request index vectors (req_pool_indices, seq_lens, prefix_lens, extend_lens,
    extend_start) arrive as views into one packed upload whose offsets follow the step's shape
    (DraftRunner.forward packs T positions first): an odd catch-up moves every one of them off
    16-byte alignment. On the H200 the first drafting steps of an adaptive SmolLM2 server at c
    = 1 took 28 ms against 2.6 ms later (`paired_smollm2_lc_h200_s28.json`), a compile's
    stall. After the first call, aligned and misaligned views reuse the one compiled kernel,
    and give the same output."""
    from sglang.srt.layers.attention.triton_ops.extend_attention import (
        _extend_attn_kernel,
        extend_attention_fwd,
    )
    from sglang.test.triton_interpreter import compiled_variants

    compiled_variants(_extend_attn_kernel)  # skips where Triton keeps no cache to inspect
    torch.manual_seed(0)
    h, hkv, d, bs = 8, 2, 64, 3
    prefix, ext = [5, 17, 40], [3, 1, 6]
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    t = sum(ext)
    r2t = torch.randperm(4096, device="cuda")[: 8 * 64].view(8, 64).to(torch.int32)
    k_buf = torch.randn(4096, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    starts = [0, 3, 4]
    outs, compiled = [], None
    for i, off in enumerate((0, 1, 3, 0)):
        # [pad x off, rows, seq, prefix, ext, starts]: every vector at an offset of `off` + k bs
        packed = torch.tensor([7] * off + [1, 4, 6] + seq + prefix + ext + starts, device="cuda")
        rows_t, seq_t, prefix_t, ext_t, starts_t = packed[off:].view(5, bs).unbind(0)
        out = torch.zeros_like(q)
        extend_attention_fwd(
            q, k_buf, v_buf, out, r2t, rows_t, seq_t, prefix_t, ext_t, starts_t, 6, d**-0.5
        )
        outs.append(out)
        if i == 0:
            compiled = compiled_variants(_extend_attn_kernel)
    torch.cuda.synchronize()
    assert compiled_variants(_extend_attn_kernel) == compiled
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_spec_engine_with_verify_as_decode_matches_no_speculation(
    tiny_model_dir, draft_dir, monkeypatch
):
    """EAGLE-3 at K = 3 on the Triton backend with SGLANG_TRITON_VERIFY_DECODE=1: the verify
    steps went through the grouped decode kernel over their token rows, and the greedy outputs
    equal those of the same target without speculation (torch_native)."""
    import sglang.srt.layers.attention.triton_backend as tb
    from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

    monkeypatch.setenv("SGLANG_TRITON_VERIFY_DECODE", "1")
    rows_calls = {"n": 0}
    real = tb.decode_attention_fwd

    def counted(*args, **kwargs):
        rows_calls["n"] += kwargs.get("rows") is not None
        return real(*args, **kwargs)

    monkeypatch.setattr(tb, "decode_attention_fwd", counted)
    n = 12
    sched = make_scheduler(
        tiny_model_dir,
        attention_backend="triton",
        device="auto",
        dtype="float32",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=3,
    )
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    for i, ids in enumerate(PROMPTS):
        submit(sched, f"r{i}", ids, params)
    outs: dict[str, dict] = {}
    run_until_idle(sched, outs)
    got = {rid: o["output_ids"] for rid, o in outs.items()}
    assert rows_calls["n"] > 0  # verify steps attended as decodes
    assert got == greedy_outputs(tiny_model_dir, "torch_native", n)
