"""flashinfer attention backend: equal to torch_native_backend.attention_reference in bf16 for
decode, prefill over a cached prefix and ragged verify (head_dim 64 / 128, GQA groups 3 / 4),
eagerly and through CUDA graphs captured with the backend's hooks and replayed with padding.
The registry refuses it off CUDA; the page-layout helpers run everywhere (Triton interpreter
on CPU)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from sglang.test.triton_interpreter import (  # first: sets TRITON_INTERPRET
    DEVICE,
    HAS_CUDA,
    compiled_variants,
)

pytest.importorskip("triton")

from sglang.srt.layers.attention import create_attention_backend  # noqa: E402
from sglang.srt.layers.attention.paged_layout import (  # noqa: E402
    fill_kv_indices,
    paged_layout,
)
from sglang.srt.layers.attention.torch_native_backend import attention_reference  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
    build_positions_and_starts,
)

HAVE_FLASHINFER = HAS_CUDA and importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAVE_FLASHINFER, reason="needs CUDA and flashinfer")
CONFIGS = [(9, 3, 64), (32, 8, 128)]  # (heads, kv heads, head_dim): SmolLM2 / Llama-8B shapes
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------- CPU-runnable
def test_registry_refuses_flashinfer_off_cuda():
    class CpuRunner:
        device = torch.device("cpu")
        dtype = torch.bfloat16

    with pytest.raises(ValueError, match="--attention-backend flashinfer needs a CUDA device"):
        create_attention_backend("flashinfer", CpuRunner())
    with pytest.raises(ValueError, match="--attention-backend flashinfer"):
        create_attention_backend("flashinfer", object())  # a runner without a device


def test_graph_workspace_covers_the_measured_8b_verify_plans():
    """FlashInfer 0.6.18 on the H200 (132 SMs) asked for 635,437,056 bytes of split-KV
    scratch planning the bs-256 x 6-token verify graph of the Llama-3.1-8B shape, and
    568,328,192 for the bs-256 x 2-token one (K = 1): the estimate covers both (the second
    overflowed an estimate proportional to tokens alone); SmolLM2 keeps the 384 MiB default.
    An overflow message is recognised, with the size it asked for."""
    from sglang.srt.layers.attention.flashinfer_workspace import (
        graph_workspace_bytes,
        workspace_overflow_bytes,
    )

    assert graph_workspace_bytes(256 * 6, 32, 128, 132) >= 635_437_056 + (32 << 20)
    assert graph_workspace_bytes(256 * 2, 32, 128, 132) >= 568_328_192 + (32 << 20)
    assert graph_workspace_bytes(256 * 6, 9, 64, 132) < 384 << 20
    msg = (
        "Error in function 'aligned_alloc' at flashinfer/allocator.h:71: Buffer overflow when "
        "allocating memory for batch_prefill_tmp_v with size 568328192 and alignment 16, but "
        "only 402653184 bytes available in AlignedAllocator. Increase the workspace buffer size."
    )
    assert workspace_overflow_bytes(RuntimeError(msg)) == 568_328_192
    assert workspace_overflow_bytes(RuntimeError("CUDA error: out of memory")) is None


def test_paged_layout_gives_unassigned_rows_to_the_last_request():
    lay = paged_layout([10, 23, 39, 6], [1, 3, 6, 2], num_tokens=14)
    assert lay.qo_indptr.tolist() == [0, 1, 4, 10, 14]
    assert lay.kv_indptr.tolist() == [0, 10, 33, 72, 80]
    assert lay.qo_indptr.dtype == lay.kv_indptr.dtype == torch.int32
    assert lay.last_page_len.tolist() == [1, 1, 1, 1]
    assert (lay.extra_rows, lay.num_pages, lay.is_decode) == (2, 80, False)
    dec = paged_layout([5, 1, 300], [1, 1, 1], num_tokens=3)
    assert dec.is_decode and dec.kv_indptr.tolist() == [0, 5, 6, 306]
    assert not paged_layout([5, 1], [1, 1], num_tokens=3).is_decode  # one unassigned row
    with pytest.raises(ValueError, match="bad step layout"):
        paged_layout([5, 1], [1, 1], num_tokens=1)


def test_paged_layout_equals_the_list_reference_on_random_steps():
    """paged_layout (numpy, a shared ones tensor) equals the plain-list construction it
    replaced on random steps (decode, ragged prefill, extra rows, zero-length requests, bad
    layouts), and layouts share nothing a caller could write through: each call's indptrs are
    its own, and the shared last_page_len stays all ones."""
    import random
    from itertools import accumulate

    def reference(seq_lens, extend_lens, num_tokens):
        bs, extra = len(seq_lens), num_tokens - sum(extend_lens)
        if bs == 0 or len(extend_lens) != bs or extra < 0:
            return None
        ext, kv = list(extend_lens), list(seq_lens)
        ext[-1] += extra
        kv[-1] += extra
        return (
            [0, *accumulate(ext)],
            [0, *accumulate(kv)],
            extra,
            sum(kv),
            extra == 0 and all(e == 1 for e in extend_lens),
        )

    rng = random.Random(0)
    for _ in range(2000):
        bs = rng.choice([0, 1, 2, 3, 7, 33])
        seq = [rng.randrange(0, 5000) for _ in range(bs)]
        ext = [rng.choice([0, 1, 1, 1, 2, 9, 300]) for _ in range(bs)]
        if bs and rng.random() < 0.05:
            ext = ext[:-1]
        n = sum(ext) + rng.choice([0, 0, 0, 1, 5, -1])
        want = reference(seq, ext, n)
        if want is None:
            with pytest.raises(ValueError, match="bad step layout"):
                paged_layout(seq, ext, n)
            continue
        lay = paged_layout(seq, ext, n)
        got = (
            lay.qo_indptr.tolist(),
            lay.kv_indptr.tolist(),
            lay.extra_rows,
            lay.num_pages,
            lay.is_decode,
        )
        assert got == want
        assert type(lay.num_pages) is int and type(lay.is_decode) is bool
        for t in (lay.qo_indptr, lay.kv_indptr, lay.last_page_len):
            assert t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()
        assert lay.last_page_len.tolist() == [1] * bs
    a = paged_layout([4, 6], [1, 1], 2)
    b = paged_layout([4, 6], [1, 1], 2)
    a.qo_indptr[1] = 99
    a.kv_indptr[1] = 99
    assert b.qo_indptr.tolist() == [0, 1, 2] and b.kv_indptr.tolist() == [0, 4, 10]


def test_fill_kv_indices_gathers_page_lists_and_pads_with_slot_zero():
    torch.manual_seed(0)
    r2t = torch.randint(1, 10_000, (6, 1100), dtype=torch.int32, device=DEVICE)
    rows = [4, 0, 2]
    seq = [700, 1, 1030]  # more than one BLOCK of 512 for two requests
    for extra in (0, 3):
        out = torch.full((sum(seq) + extra,), -1, dtype=torch.int32, device=DEVICE)
        fill_kv_indices(
            r2t, torch.tensor(rows, device=DEVICE), torch.tensor(seq, device=DEVICE), extra, out
        )
        want = torch.cat([r2t[r, :n] for r, n in zip(rows, seq, strict=True)]).cpu().tolist()
        assert out.cpu().tolist() == want + [0] * extra


def test_fill_kv_indices_many_requests_and_offset_views():
    """More requests than one prefix tile (PREFIX_BLOCK = 128: 300 requests, the last one at
    a tile's far end), index vectors that are views at odd element offsets (as
    int64_to_device's split hands them out), and every padding count; the page lists are
    the same gathers."""
    g = torch.Generator().manual_seed(1)
    bs = 300
    r2t = torch.randint(1, 10_000, (bs + 2, 80), dtype=torch.int32, generator=g).to(DEVICE)
    rows = torch.randperm(bs + 2, generator=g)[:bs].tolist()
    seq = torch.randint(1, 80, (bs,), generator=g).tolist()
    packed = torch.tensor([7] + rows + seq, dtype=torch.int64, device=DEVICE)
    rows_t, seq_t = packed[1 : 1 + bs], packed[1 + bs :]  # offsets of 1 and bs + 1 elements
    want = torch.cat([r2t[r, :n] for r, n in zip(rows, seq, strict=True)]).cpu().tolist()
    for extra in (0, 1, 16):
        out = torch.full((sum(seq) + extra,), -1, dtype=torch.int32, device=DEVICE)
        fill_kv_indices(r2t, rows_t, seq_t, extra, out)
        assert out.cpu().tolist() == want + [0] * extra


@pytest.mark.skipif(not HAS_CUDA, reason="compiled Triton kernels need CUDA")
def test_fill_kv_indices_compiles_once_for_any_step_shape():
    """Batch sizes, padding counts and index-vector offsets that change every step must not
    compile new variants mid-serving (on the H200 the earlier kernel, with a power-of-two
    constexpr and specialized integers, was compiled again and again under load): after the
    first call, every other shape reuses the one compiled kernel."""
    from sglang.srt.layers.attention import paged_layout as pl

    kernel = pl._fill_kv_indices_kernel
    compiled_variants(kernel)  # skips where Triton keeps no cache to inspect
    r2t = torch.randint(1, 1000, (512, 64), dtype=torch.int32, device="cuda")
    idx = torch.arange(600, dtype=torch.int64, device="cuda")
    sizes = [(1, 0), (16, 0), (17, 1), (32, 16), (200, 3), (300, 0)]
    for i, (bs, extra) in enumerate(sizes):
        off = i % 2  # an aligned and a misaligned view in turn
        rows = idx[off : off + bs]
        seq = torch.cat([idx[:1], (rows % 60) + 1])[1 - off :]  # offset 1 when off == 0
        out = torch.empty(int(seq.sum()) + extra, dtype=torch.int32, device="cuda")
        fill_kv_indices(r2t, rows, seq, extra, out)
        if i == 0:  # other tests of this process may have compiled other strides' variants
            compiled = compiled_variants(kernel)
    torch.cuda.synchronize()
    assert compiled_variants(kernel) == compiled


# ---------------------------------------------------------------------- GPU helpers
class World:
    """A KV pool (one layer) and request table with shuffled slots, as the scheduler leaves
    them; steps write fresh slots into the given request rows."""

    def __init__(self, h: int, hkv: int, d: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.h, self.hkv, self.d = h, hkv, d
        self.pool = MHATokenToKVPool(4096, torch.bfloat16, hkv, d, 1, "cuda")
        self.r2t = ReqToTokenPool(8, 512, "cuda")
        self.free = (torch.randperm(4096) + 1).tolist()  # slot 0 stays the padding slot
        self.runner = SimpleNamespace(
            device=torch.device("cuda"),
            dtype=torch.bfloat16,
            model_config=SimpleNamespace(num_attention_heads=h),
            req_to_token_pool=self.r2t,
        )
        self.layer = RadixAttention(h, d, d**-0.5, hkv, 0)

    def step(self, rows: list[int], prefix: list[int], ext: list[int]):
        """Returns (fb, (q, k, v), expected [T, h * d] float32 from attention_reference)."""
        h, hkv, d, pool = self.h, self.hkv, self.d, self.pool
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        out_loc = []
        for row, p, n in zip(rows, prefix, seq, strict=True):
            slots = torch.tensor([self.free.pop() for _ in range(n)], device="cuda")
            self.r2t.write(row, 0, slots)
            pool.k_buffer[0][slots[:p]] = torch.randn(p, hkv, d, device="cuda").bfloat16()
            pool.v_buffer[0][slots[:p]] = torch.randn(p, hkv, d, device="cuda").bfloat16()
            out_loc.append(slots[p:])
        t = sum(ext)
        pos, starts = build_positions_and_starts(prefix, ext, "cuda")
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if max(ext) == 1 else ForwardMode.TARGET_VERIFY,
            batch_size=len(rows),
            input_ids=torch.zeros(t, dtype=torch.int64, device="cuda"),
            positions=pos,
            out_cache_loc=torch.cat(out_loc),
            req_pool_indices=torch.tensor(rows, device="cuda"),
            seq_lens=torch.tensor(seq, device="cuda"),
            extend_seq_lens=torch.tensor(ext, device="cuda"),
            extend_prefix_lens=torch.tensor(prefix, device="cuda"),
            extend_start_loc=starts,
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=list(ext),
            extend_prefix_lens_cpu=list(prefix),
            logits_indices=starts,
            req_to_token_pool=self.r2t,
            token_to_kv_pool=pool,
        )
        q = torch.randn(t, h * d, device="cuda").bfloat16()
        k = torch.randn(t, hkv * d, device="cuda").bfloat16()
        v = torch.randn(t, hkv * d, device="cuda").bfloat16()
        kk, vv = pool.k_buffer[0].float(), pool.v_buffer[0].float()
        kk[fb.out_cache_loc] = k.view(t, hkv, d).float()
        vv[fb.out_cache_loc] = v.view(t, hkv, d).float()
        expected, s = [], 0
        for i, row in enumerate(rows):
            slots = self.r2t.req_to_token[row, : seq[i]].long()
            qi = q[s : s + ext[i]].view(-1, h, d).float()
            expected.append(attention_reference(qi, kk[slots], vv[slots], d**-0.5, prefix[i]))
            s += ext[i]
        return fb, (q, k, v), torch.cat(expected).reshape(t, h * d)

    def eager(self, backend, fb, qkv) -> torch.Tensor:
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        return self.layer(*qkv, fb)


CASES = {
    "decode": ([3, 1, 6], [5, 17, 300], [1, 1, 1]),
    "prefill": ([3, 1, 6], [0, 7, 40], [13, 5, 70]),  # one without a cached prefix
    "verify": ([3, 1, 6, 2], [9, 20, 33, 4], [1, 3, 6, 2]),
}


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cfg", CONFIGS)
def test_eager_matches_reference(cfg, case):
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    world = World(*cfg)
    backend = create_attention_backend("flashinfer", world.runner)
    assert isinstance(backend, FlashInferAttnBackend)
    fb, qkv, expected = world.step(*CASES[case])
    out = world.eager(backend, fb, qkv)
    assert fb.attn_metadata.is_decode == (case == "decode")
    if case == "decode":  # GQA group 4 decodes on tensor cores, group 3 on CUDA cores
        assert fb.attn_metadata.wrapper.use_tensor_cores == (cfg[0] // cfg[1] >= 4)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)
    # The step's K/V went to its slots.
    t = fb.num_tokens
    k_pool = world.pool.k_buffer[0][fb.out_cache_loc]
    assert torch.equal(k_pool, qkv[1].view(t, cfg[1], cfg[2]))


@pytest.mark.gpu
@needs_flashinfer
def test_float32_model_and_unsupported_head_dim_are_refused():
    world = World(9, 3, 64)
    world.runner.dtype = torch.float32
    with pytest.raises(ValueError, match="--dtype bfloat16 or float16"):
        create_attention_backend("flashinfer", world.runner)
    world.runner.dtype = torch.bfloat16
    world.runner.token_to_kv_pool = MHATokenToKVPool(64, torch.bfloat16, 2, 16, 1, "cuda")
    with pytest.raises(ValueError, match="head_dim"):
        create_attention_backend("flashinfer", world.runner)


# Replays of one captured graph: (rows, prefixes, extend lens) of the real requests; the rest of
# the bs-4 graph is padding (pad requests, then unassigned token rows).
GRAPH_STEPS = {
    "decode": [
        ([3, 1, 6], [5, 40, 300], [1, 1, 1]),  # 3 real + 1 pad request
        ([2, 6, 5, 7], [17, 2, 130, 64], [1, 1, 1, 1]),  # full, new lengths
    ],
    "verify": [
        ([3, 1, 6], [9, 20, 33], [1, 3, 2]),  # 6 tokens + 1 pad request + 1 unassigned row
        ([2, 6, 5, 7], [4, 60, 7, 100], [1, 3, 2, 1]),  # 7 tokens + 1 unassigned row
    ],
}


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("kind", sorted(GRAPH_STEPS))
@pytest.mark.parametrize("cfg", CONFIGS)
def test_cuda_graph_replay_with_padding_equals_eager(cfg, kind, lean, monkeypatch):
    """lean: SGLANG_FLASHINFER_LEAN_PLAN=1, replays re-plan through flashinfer_replan."""
    monkeypatch.setenv("SGLANG_FLASHINFER_LEAN_PLAN", "1" if lean else "0")
    world = World(*cfg, seed=1)
    h, hkv, d = cfg
    backend = create_attention_backend("flashinfer", world.runner)
    bs, n = 4, 4 if kind == "decode" else 8
    e = n // bs
    backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=8)
    i64 = dict(dtype=torch.int64, device="cuda")
    static = {name: torch.zeros(bs, **i64) for name in ("rows", "seq", "ext", "pre", "start")}
    loc = torch.zeros(n, **i64)
    q_s = torch.zeros(n, h * d, dtype=torch.bfloat16, device="cuda")
    k_s = torch.zeros(n, hkv * d, dtype=torch.bfloat16, device="cuda")
    v_s = torch.zeros_like(k_s)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if e == 1 else ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=torch.zeros(n, **i64),
        positions=torch.zeros(n, **i64),
        out_cache_loc=loc,
        req_pool_indices=static["rows"],
        seq_lens=static["seq"],
        extend_seq_lens=static["ext"],
        extend_prefix_lens=static["pre"],
        extend_start_loc=static["start"],
        seq_lens_cpu=[e] * bs,  # capture: every request computes e tokens from position 0
        extend_seq_lens_cpu=[e] * bs,
        extend_prefix_lens_cpu=[0] * bs,
        logits_indices=torch.arange(n, **i64),
        req_to_token_pool=world.r2t,
        token_to_kv_pool=world.pool,
        attn_backend=backend,
    )
    static["seq"].fill_(e)
    static["ext"].fill_(e)
    backend.init_forward_metadata_capture_cuda_graph(fb, e)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            world.layer(q_s, k_s, v_s, fb)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = world.layer(q_s, k_s, v_s, fb)

    eager_backend = create_attention_backend("flashinfer", world.runner)
    for rows, prefix, ext in GRAPH_STEPS[kind]:
        real, qkv, expected = world.step(rows, prefix, ext)
        t, pad = sum(ext), bs - len(rows)
        seq = [p + x for p, x in zip(prefix, ext, strict=True)] + [1] * pad
        ext_p = list(ext) + [1] * pad
        starts = [sum(ext_p[:i]) for i in range(bs)]
        for name, vals in (
            ("rows", list(rows) + [0] * pad),
            ("seq", seq),
            ("ext", ext_p),
            ("pre", [s - x for s, x in zip(seq, ext_p, strict=True)]),
            ("start", starts),
        ):
            static[name].copy_(torch.tensor(vals))
        loc.zero_()
        loc[:t] = real.out_cache_loc  # pad requests and unassigned rows write slot 0
        for dst, src in zip((q_s, k_s, v_s), qkv, strict=True):
            dst.zero_()
            dst[:t] = src
        fb.seq_lens_cpu, fb.extend_seq_lens_cpu = seq, ext_p
        fb.extend_prefix_lens_cpu = [s - x for s, x in zip(seq, ext_p, strict=True)]
        backend.init_forward_metadata_replay_cuda_graph(fb, e)
        graph.replay()
        got = out_s[:t].float()
        torch.testing.assert_close(got, expected, **BF16_TOL)
        eager = world.eager(eager_backend, real, qkv)
        torch.testing.assert_close(got, eager.float(), atol=1e-2, rtol=1e-2)
    ((wrapper, _),) = backend._graph_wrappers.values()
    assert backend._lean_ok.get(wrapper, False) == lean


def test_capture_plan_overflow_grows_the_workspace_and_replans(monkeypatch):
    """The grow-and-retry path of graph capture, without a GPU: the first plan of a graph
    overflows FlashInfer's float workspace (its AlignedAllocator message); the backend grows
    the workspace by what was asked (+ 64 MiB), builds a new wrapper over it and plans again.
    Other errors, and overflows of integer-workspace buffers, propagate."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention import flashinfer_backend as fib

    sizes = []

    class FakeWs:
        def __init__(self, n: int) -> None:
            self.n = n

        def numel(self) -> int:
            return self.n

    def fake_workspace(device, min_bytes=0):
        sizes.append(min_bytes)
        return FakeWs(min_bytes)

    monkeypatch.setattr(fib, "float_workspace", fake_workspace)
    be = object.__new__(fib.FlashInferAttnBackend)
    be.device, be.num_qo_heads, be._graph_wrappers = "cpu", 32, {}
    be._graph = object()  # capture state exists
    be.workspace = FakeWs(400 << 20)
    built, plans = [], []
    be._new_wrapper = lambda is_decode, use_tc, bs=None: built.append(be.workspace.n) or len(built)
    overflow = (
        "Buffer overflow when allocating memory for batch_prefill_tmp_v with size 568328192 and "
        "alignment 16, but only 402653184 bytes available in AlignedAllocator."
    )

    def replay(fb, max_extend_len):
        plans.append(be._graph_wrappers[(fb.batch_size, fb.num_tokens)][0])
        if len(plans) == 1:
            raise RuntimeError(overflow)

    be.init_forward_metadata_replay_cuda_graph = replay
    fb = SimpleNamespace(
        batch_size=256, num_tokens=512, token_to_kv_pool=SimpleNamespace(head_num=8)
    )
    be.init_forward_metadata_capture_cuda_graph(fb, 2)
    assert plans == [1, 2]  # planned on the first wrapper, then on one over the grown buffer
    assert sizes == [(400 << 20) + 568_328_192 + (64 << 20)]
    assert built == [400 << 20, sizes[0]] and be._graph_wrappers[(256, 512)][0] == 2

    def fails(msg):
        def replay(fb, max_extend_len):
            raise RuntimeError(msg)

        return replay

    for msg in (
        "CUDA error: an illegal memory access",
        overflow.replace("tmp_v", "request_indices"),
    ):
        be.init_forward_metadata_replay_cuda_graph = fails(msg)
        with pytest.raises(RuntimeError, match=msg[:20]):
            be.init_forward_metadata_capture_cuda_graph(fb, 2)
    # A second runner capturing a key whose wrapper an earlier graph shares (a draft's decode
    # graphs after its extend graphs): no silent new wrapper, which would leave the earlier
    # graph replaying a stale plan.
    be.init_forward_metadata_replay_cuda_graph = fails(overflow)
    with pytest.raises(RuntimeError, match="another runner's graph shares"):
        be.init_forward_metadata_capture_cuda_graph(fb, 2)
    assert be._graph_wrappers[(256, 512)][0] == 2
