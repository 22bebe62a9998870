"""CUDA-graph runner: bucket choice, and padded replays equal to eager forwards.

On CPU the runner runs its padded static batch eagerly (use_graphs=False): the same buffers,
padding and slicing as a graph replay, so the padding logic is tested everywhere. The GPU tests
capture real graphs (triton backend) and compare with eager forwards and with
--disable-cuda-graph end to end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sglang.srt.managers.schedule_batch import ModelWorkerBatch
from sglang.srt.model_executor.cuda_graph_buckets import (
    GraphKey,
    graph_batch_sizes,
    prefill_token_buckets,
)
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.test.scheduler_utils import (
    count_calls,
    make_scheduler,
    record_step_proposals,
    run_until_idle,
    submit,
)
from sglang.test.tiny_models import make_tiny_model_dir

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_graph_batch_sizes_and_pick():
    assert graph_batch_sizes(None, None, 1024)[-1] == 256
    assert graph_batch_sizes(None, 16, 1024) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(None, None, 20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes([3, 1, 8], None, 1024) == [1, 3, 8]
    assert graph_batch_sizes([300], None, 1024) == [300]  # the list sets the cap
    assert graph_batch_sizes([512], None, 256) == [256]  # never empty
    assert graph_batch_sizes([4, 300], 8, 1024) == [4]

    class _Stub(CudaGraphRunner):
        def __init__(self, sizes, ext, prefill=()):  # bucket logic only
            self.batch_sizes, self.max_extend_len = sizes, ext
            self.token_buckets = {b: [b * (1 + k) for k in range(ext)] for b in sizes}
            self.token_buckets[sizes[0]] += list(prefill)
            self.max_bs, self.prefill_buckets = sizes[-1], list(prefill)

    r = _Stub([1, 2, 4, 8], 4)
    assert r.pick(3, 3) == GraphKey(4, 4)  # decode: 3 real + 1 pad
    assert r.pick(3, 6) == GraphKey(4, 8)  # verify: 6 tokens + 1 pad token
    assert r.pick(4, 16) == GraphKey(4, 16)
    assert r.pick(4, 17) == GraphKey(8, 24)  # 17 tokens + 4 pad tokens fit the bs-8 bucket
    assert r.pick(8, 33) is None  # more than max_extend_len tokens per request on average
    assert r.pick(8, 9) == GraphKey(8, 16)
    assert r.pick(9, 9) is None  # beyond the largest bucket
    assert GraphKey(4, 12).max_extend_len == 3
    # what the attention backend must cover: the longest request a bucket can hold
    assert r.longest_request(GraphKey(4, 8)) == 4  # 8 - 3 one-token requests, capped at 4
    assert r.longest_request(GraphKey(4, 4)) == 1
    assert r.longest_request(GraphKey(2, 4)) == 3
    wide = _Stub([1, 2], 40)  # K = 39: lens (40, 1) replay bucket (2, 42), 21 per request
    assert wide.pick(2, 41) == GraphKey(2, 42) and wide.longest_request(GraphKey(2, 42)) == 40
    # prefill buckets (bs 1 only): a single request of up to 32 tokens
    assert prefill_token_buckets(0, 4) == []
    assert prefill_token_buckets(100, 4) == [16, 32, 64, 128]
    assert prefill_token_buckets(16, 6) == [16]
    assert prefill_token_buckets(20, 20) == [32]
    assert prefill_token_buckets(10, 20) == []  # the verify buckets already hold 10 tokens
    p = _Stub([1, 2, 4], 4, prefill=prefill_token_buckets(32, 4))
    assert p.pick(1, 4) == GraphKey(1, 4)  # verify bucket first
    assert p.pick(1, 5) == GraphKey(1, 16) and p.longest_request(GraphKey(1, 16)) == 16
    assert p.pick(1, 32) == GraphKey(1, 32) and p.pick(1, 33) is None
    assert p.fits([30]) and not p.fits([33])
    assert p.fits([3, 3]) and not p.fits([5, 1])  # two requests: never a prefill bucket


class Requests:
    """Requests placed straight into a runner's pools (what the scheduler would do)."""

    def __init__(self, runner, prompts: list[list[int]]):
        self.runner = runner
        self.rows = runner.req_to_token_pool.alloc(len(prompts))
        self.ids = [list(p) for p in prompts]
        self.kv = [0] * len(prompts)

    def batch(self, reqs: list[int], new: list[list[int]], mode: ForwardMode) -> ModelWorkerBatch:
        """Request reqs[j] computes tokens new[j] (all rows are logits rows)."""
        r = self.runner
        slots = []
        for i, toks in zip(reqs, new, strict=True):
            s = r.token_to_kv_pool_allocator.alloc(len(toks))
            r.req_to_token_pool.write(self.rows[i], self.kv[i], s)
            slots.append(s)
        mwb = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=torch.tensor([t for toks in new for t in toks], dtype=torch.int64),
            out_cache_loc=torch.cat(slots),
            req_pool_indices=[self.rows[i] for i in reqs],
            seq_lens=[self.kv[i] + len(t) for i, t in zip(reqs, new, strict=True)],
            extend_prefix_lens=[self.kv[i] for i in reqs],
            extend_seq_lens=[len(t) for t in new],
            num_logit_rows=[len(t) for t in new],
            sample=[True] * len(reqs),
            input_logprob_targets=[[] for _ in reqs],
            sampling_info=None,
        )
        for i, toks in zip(reqs, new, strict=True):
            self.kv[i] += len(toks)
        return mwb

    def rewind(self, reqs: list[int], n: list[int]) -> None:
        for i, k in zip(reqs, n, strict=True):
            self.kv[i] -= k


# (requests, their new tokens) of the padded-replay checks, after prefill_verify_prompts
VERIFY_STEPS = [
    ([0, 1, 2], [[11], [12], [13]]),  # decode, 3 real + 1 pad in the bs-4 graph
    ([0, 1, 2], [[21], [22, 23, 24], [25, 26]]),  # ragged verify
    ([0, 1, 2, 3, 4], [[31], [32], [33, 34, 35, 36], [37], [38, 39]]),  # bs 5 -> 8
    ([4], [[41, 42, 43]]),
]


def prefill_verify_prompts(runner) -> Requests:
    """Five seeded prompts (7, 3, 12, 5 and 9 tokens) placed in runner's pools and prefilled
    eagerly (their KV), for VERIFY_STEPS."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 3, 12, 5, 9)]
    reqs = Requests(runner, prompts)
    runner.forward_worker_batch(reqs.batch(list(range(5)), prompts, ForwardMode.EXTEND))
    return reqs


def check_padded_equals_eager(
    runner, graphs: CudaGraphRunner, mode: CaptureHiddenMode, atol, same_argmax: bool = True
):
    reqs = prefill_verify_prompts(runner)
    for idx, new in VERIFY_STEPS:
        mwb = reqs.batch(idx, new, ForwardMode.TARGET_VERIFY)
        assert graphs.can_run(mwb, mode)
        eager = runner.forward_worker_batch(mwb, capture_hidden_mode=mode)
        k_eager = runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc].clone()
        padded = graphs.replay(mwb)
        k_pad = runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc]
        torch.testing.assert_close(k_pad, k_eager, atol=atol, rtol=0)
        assert padded.next_token_logits.shape == eager.next_token_logits.shape
        torch.testing.assert_close(
            padded.next_token_logits, eager.next_token_logits, atol=atol, rtol=0
        )
        if mode == CaptureHiddenMode.LAST:
            torch.testing.assert_close(padded.hidden_states, eager.hidden_states, atol=atol, rtol=0)
        if same_argmax:  # (not across bf16 kernels of two backends: near-ties may flip)
            assert torch.equal(
                padded.next_token_logits.argmax(-1), eager.next_token_logits.argmax(-1)
            )
        if runner.device.type == "cuda":  # ids resolved on the device (overlap scheduling)
            first = padded.next_token_logits.clone()  # a view the next replay overwrites
            on_dev = graphs.replay(replace(mwb, input_ids=mwb.input_ids.to(runner.device)))
            assert torch.equal(on_dev.next_token_logits, first)


def test_decode_fill_writes_what_the_ragged_fill_writes(tiny_model_dir):
    """The decode shortcut of _fill (one token per request) stages the same packed buffer and
    the same host lists as the general (ragged) fill, padded requests included, with ids on
    the host or left to a device copy."""
    sched = make_scheduler(tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=4096)
    runner = sched.tp_worker.model_runner
    graphs = CudaGraphRunner(
        runner, CaptureHiddenMode.NULL, max_extend_len=3, batch_sizes=[1, 2, 4, 8], use_graphs=False
    )
    rng = torch.Generator().manual_seed(3)
    for bs in (1, 2, 3, 5, 8):
        key = graphs.pick(bs, bs)
        assert key.num_tokens == key.bs >= bs
        pools = torch.randperm(16, generator=rng)[:bs].tolist()
        seq = torch.randint(1, 900, (bs,), generator=rng).tolist()
        ids = torch.randint(0, 500, (bs,), generator=rng)
        loc = torch.randint(1, 4000, (bs,), generator=rng)
        got = []
        for fill in (graphs._fill_decode, graphs._fill_ragged):
            graphs.inputs.hosts[graphs.inputs.turn ^ 1].fill_(-7)  # the buffer fill will stage
            args = (key, pools, seq, [1] * bs, ids, loc)
            fb = fill(*args[:3], *args[4:]) if fill == graphs._fill_decode else fill(*args)
            lists = (fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
            got.append((graphs.inputs.hosts[graphs.inputs.turn].clone(), lists))
        assert _same_fields(graphs, key, got)
        assert got[0][1] == got[1][1]


def _same_fields(graphs, key, got) -> bool:
    """The packed buffers agree on every field's entries that the key's graph reads."""
    inp = graphs.inputs
    for k, count in enumerate([key.bs] * 5 + [key.num_tokens] * 3):
        a, b = (inp.region(g[0], k, count) for g in got)
        if not torch.equal(a, b):
            return False
    return True


def _cpu_graphs(tiny_model_dir, mode, **kw):
    """(runner, graphs): a CPU runner and a graph runner over it with bs buckets 1..8 and
    K + 1 = 4, whose padded static batches run eagerly (use_graphs False)."""
    sched = make_scheduler(tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=2048)
    runner = sched.tp_worker.model_runner
    return runner, CudaGraphRunner(
        runner, mode, max_extend_len=4, batch_sizes=[1, 2, 4, 8], use_graphs=False, **kw
    )


@pytest.mark.parametrize("mode", [CaptureHiddenMode.NULL, CaptureHiddenMode.LAST])
def test_padded_static_batch_equals_eager_cpu(tiny_model_dir, mode):
    runner, graphs = _cpu_graphs(tiny_model_dir, mode)
    check_padded_equals_eager(runner, graphs, mode, atol=1e-4)
    batch = ModelWorkerBatch(
        ForwardMode.EXTEND, torch.tensor([1, 2]), torch.tensor([1, 2]), [0], [2], [0], [2],
        [1], [True], [[]], None,
    )  # fmt: skip
    assert not graphs.can_run(batch, mode)  # a prefill row that is not a logits row
    assert not graphs.can_run(batch, CaptureHiddenMode.FULL)


def check_prefill_equals_eager(
    runner, graphs: CudaGraphRunner, mode: CaptureHiddenMode, atol, max_bs: int = 1
):
    """Single-request prefills through the prefill buckets equal eager prefills: a prompt of 10
    tokens (bucket 16, padded), one of exactly 16, a 12-token chunk after 5 cached tokens (a
    prefix) and one token after those 17, with the last row's logits (or none, for a chunk
    that does not sample), the KV written and, when captured, the hidden states (FULL: every
    row)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (10, 16, 17)]
    reqs = Requests(runner, prompts)
    cases = [([0], [prompts[0]], 1), ([1], [prompts[1]], 1)]
    cases += [([2], [prompts[2][:5]], 0), ([2], [prompts[2][5:]], 1)]
    # one token after the prompt (a fully cached prompt recomputes its last token): a decode
    # bucket replays it, FULL included on a LAST runner (every row is a logits row)
    cases += [([2], [[42]], 1)]
    for idx, new, rows in cases:
        mwb = replace(reqs.batch(idx, new, ForwardMode.EXTEND), num_logit_rows=[rows])
        want_modes = [mode] + ([CaptureHiddenMode.FULL] if mode == CaptureHiddenMode.LAST else [])
        for m in want_modes:
            t = len(new[0])
            assert graphs.can_run(mwb, m) == (t > graphs.max_extend_len or rows == t)
            if not graphs.can_run(mwb, m):
                continue
            eager = runner.forward_worker_batch(mwb, capture_hidden_mode=m)
            k_eager = runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc].clone()
            padded = graphs.replay(mwb, m)
            k_pad = runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc]
            torch.testing.assert_close(k_pad, k_eager, atol=atol, rtol=0)
            assert padded.next_token_logits.shape == (rows, eager.next_token_logits.shape[1])
            torch.testing.assert_close(
                padded.next_token_logits, eager.next_token_logits, atol=atol, rtol=0
            )
            if m == CaptureHiddenMode.NULL:
                assert padded.hidden_states is None
            else:
                assert padded.hidden_states.shape[0] == (t if m == CaptureHiddenMode.FULL else rows)
                torch.testing.assert_close(
                    padded.hidden_states, eager.hidden_states, atol=atol, rtol=0
                )
    two = reqs.batch([0, 1], [[7], [8, 9]], ForwardMode.EXTEND)
    two = replace(two, num_logit_rows=[1, 1])
    if max_bs == 1:
        assert not graphs.can_run(two, mode)  # one request only
    long = reqs.batch([0], [list(range(40))], ForwardMode.EXTEND)
    assert not graphs.can_run(replace(long, num_logit_rows=[1]), mode)  # beyond 32 tokens
    logprobs = replace(mwb, return_logprob=True, input_logprob_targets=[[1]])
    assert not graphs.can_run(logprobs, mode)  # input logprobs need every row's logprobs


def _cuda_runner(tiny_model_dir: str, mode: CaptureHiddenMode):
    """The model runner of a float32 triton scheduler on CUDA without its own graphs (the
    tests capture theirs), with the EAGLE-3 aux capture on for mode LAST."""
    sched = make_scheduler(
        tiny_model_dir, device="cuda", dtype="float32", attention_backend="triton",
        max_total_tokens=4096, disable_cuda_graph=True,
    )  # fmt: skip
    runner = sched.tp_worker.model_runner
    if mode == CaptureHiddenMode.LAST:
        runner.model.set_eagle3_layers_to_capture()
    return runner


def test_triton_verify_is_on_by_default_under_flashinfer(monkeypatch):
    """ModelRunner.triton_verify_backend: on by default for a FlashInfer target's verify
    buckets (max_extend_len > 1); SGLANG_TRITON_VERIFY=0, another attention backend, decode-only
    graphs (max_extend_len 1) or a head size Triton does not take give None."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention import triton_backend
    from sglang.srt.model_executor.model_runner import ModelRunner

    class FakeTriton:  # stands in for the backend, which needs a CUDA runner
        def __init__(self, runner) -> None:
            self.runner = runner

    monkeypatch.setattr(triton_backend, "TritonAttnBackend", FakeTriton)
    monkeypatch.delenv("SGLANG_TRITON_VERIFY", raising=False)
    runner = SimpleNamespace(
        attention_backend_name="flashinfer", model_config=SimpleNamespace(head_dim=64)
    )
    pick = ModelRunner.triton_verify_backend
    assert isinstance(pick(runner, 4), FakeTriton) and pick(runner, 4).runner is runner
    assert pick(runner, 1) is None  # decode-only graphs
    monkeypatch.setenv("SGLANG_TRITON_VERIFY", "0")
    assert pick(runner, 4) is None
    monkeypatch.setenv("SGLANG_TRITON_VERIFY", "1")
    assert isinstance(pick(runner, 4), FakeTriton)
    assert pick(SimpleNamespace(**{**vars(runner), "attention_backend_name": "triton"}), 4) is None
    assert not triton_backend.head_dim_supported(48)
    assert (
        pick(SimpleNamespace(**{**vars(runner), "model_config": SimpleNamespace(head_dim=48)}), 4)
        is None
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter: CPU machines")
def test_triton_verify_backend_equals_eager_cpu(tiny_model_dir):
    """Verify buckets of bs <= verify_backend_max_bs and decode buckets of bs <=
    decode_backend_max_bs capture the verify backend (here Triton, through the interpreter,
    under a torch_native runner), every other bucket the runner's; decode and ragged verify
    replays in both kinds of bucket equal the eager forward. (With
    CUDA present Triton compiles for the GPU and cannot take these CPU tensors; the GPU
    version is the test below.)"""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    sched = make_scheduler(tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=2048)
    runner = sched.tp_worker.model_runner
    triton = TritonAttnBackend(runner)
    mode = CaptureHiddenMode.LAST
    graphs = CudaGraphRunner(
        runner, mode, max_extend_len=4, batch_sizes=[1, 2, 4, 8], use_graphs=False,
        verify_backend=triton, verify_backend_max_bs=4, decode_backend_max_bs=2,
    )  # fmt: skip
    assert graphs.backend_of(GraphKey(4, 8)) is triton
    assert graphs.backend_of(GraphKey(1, 4)) is triton
    assert graphs.batches[GraphKey(4, 8)].attn_backend is triton
    assert graphs.backend_of(GraphKey(2, 2)) is triton  # decode, bs 2 <= 2
    assert graphs.backend_of(GraphKey(4, 4)) is runner.attn_backend  # decode, bs 4 > 2
    assert graphs.backend_of(GraphKey(8, 16)) is runner.attn_backend  # bs 8 > 4
    check_padded_equals_eager(runner, graphs, mode, atol=1e-4)


def test_triton_decode_graph_max_bs(monkeypatch):
    """ModelRunner.triton_decode_graph_max_bs: SGLANG_TRITON_DECODE_GRAPH_MAX_BS (default
    TRITON_DECODE_GRAPH_MAX_BS) under a FlashInfer target, 0 for another backend or a head size
    Triton does not take; a value that is not a non-negative integer is a ValueError naming
    the variable."""
    from types import SimpleNamespace

    from sglang.srt.model_executor import model_runner as mr

    runner = SimpleNamespace(
        attention_backend_name="flashinfer", model_config=SimpleNamespace(head_dim=128)
    )
    pick = mr.ModelRunner.triton_decode_graph_max_bs
    monkeypatch.delenv("SGLANG_TRITON_DECODE_GRAPH_MAX_BS", raising=False)
    assert pick(runner) == mr.TRITON_DECODE_GRAPH_MAX_BS == 8  # on by default (H200 results)
    monkeypatch.setenv("SGLANG_TRITON_DECODE_GRAPH_MAX_BS", "16")
    assert pick(runner) == 16
    assert pick(SimpleNamespace(**{**vars(runner), "attention_backend_name": "triton"})) == 0
    other_head = SimpleNamespace(**{**vars(runner), "model_config": SimpleNamespace(head_dim=96)})
    assert pick(other_head) == 0
    for bad in ("-1", "eight", "1.5"):
        monkeypatch.setenv("SGLANG_TRITON_DECODE_GRAPH_MAX_BS", bad)
        with pytest.raises(ValueError, match="SGLANG_TRITON_DECODE_GRAPH_MAX_BS"):
            pick(runner)


def test_init_cuda_graphs_wires_triton_per_knob(monkeypatch):
    """ModelRunner.init_cuda_graphs hands CudaGraphRunner one Triton backend for both graph
    kinds, with SGLANG_TRITON_VERIFY and SGLANG_TRITON_DECODE_GRAPH_MAX_BS each deciding its
    own kind: verify opted out keeps decode graphs on Triton (verify_backend_max_bs 0), decode
    opted out keeps verify graphs, both out passes no backend, and a server without drafting
    never gets Triton verify graphs. (A regression: the verify opt-out was ignored on
    speculative servers once decode graphs took Triton by default.)"""
    from types import SimpleNamespace

    from sglang.srt.layers.attention import triton_backend
    from sglang.srt.model_executor import model_runner as mr

    class FakeTriton:  # stands in for the backend, which needs a CUDA runner
        def __init__(self, runner) -> None:
            self.runner = runner

    seen = {}

    def fake_graph_runner(runner, mode, max_extend_len, sizes, **kw) -> str:
        seen.clear()
        seen.update(kw)
        return "graphs"

    monkeypatch.setattr(triton_backend, "TritonAttnBackend", FakeTriton)
    monkeypatch.setattr(mr, "CudaGraphRunner", fake_graph_runner)
    sa = SimpleNamespace(
        disable_cuda_graph=False, cuda_graph_bs=None, cuda_graph_max_bs=64,
        max_running_requests=64, cuda_graph_prefill_max_tokens=None, cuda_graph_prefill_max_bs=1,
    )  # fmt: skip
    runner = SimpleNamespace(
        server_args=sa, device=torch.device("cuda"), attention_backend_name="flashinfer",
        attn_backend=SimpleNamespace(supports_cuda_graph=True),
        model_config=SimpleNamespace(head_dim=64), cuda_graph_runner=None,
    )  # fmt: skip
    runner.triton_verify_backend = lambda n: mr.ModelRunner.triton_verify_backend(runner, n)
    runner.triton_decode_graph_max_bs = lambda: mr.ModelRunner.triton_decode_graph_max_bs(runner)

    def wiring(max_extend_len: int, verify: str | None, decode: str | None):
        for name, value in (("TRITON_VERIFY", verify), ("TRITON_DECODE_GRAPH_MAX_BS", decode)):
            if value is None:
                monkeypatch.delenv(f"SGLANG_{name}", raising=False)
            else:
                monkeypatch.setenv(f"SGLANG_{name}", value)
        mr.ModelRunner.init_cuda_graphs(runner, CaptureHiddenMode.NULL, max_extend_len)
        assert runner.cuda_graph_runner == "graphs"
        backend = seen["verify_backend"]
        assert backend is None or isinstance(backend, FakeTriton)
        return backend is not None, seen["verify_backend_max_bs"], seen["decode_backend_max_bs"]

    dflt = mr.TRITON_DECODE_GRAPH_MAX_BS
    assert wiring(4, None, None) == (True, mr.TRITON_VERIFY_MAX_BS, dflt)
    assert wiring(4, "0", None) == (True, 0, dflt)  # verify opted out, decode keeps Triton
    assert wiring(4, None, "0") == (True, mr.TRITON_VERIFY_MAX_BS, 0)
    assert wiring(4, "0", "0") == (False, 0, 0)
    assert wiring(1, None, None) == (True, 0, dflt)  # no drafting: decode graphs only
    assert wiring(1, None, "0") == (False, 0, 0)
    runner.attention_backend_name = "triton"  # the runner's own backend: no second one
    assert wiring(4, None, None) == (False, 0, 0)


def _verify_step_logits(runner, run) -> list[torch.Tensor]:
    """prefill_verify_prompts, then VERIFY_STEPS through run(mwb) -> logits [R, V]; returns
    each step's logits as float32."""
    reqs = prefill_verify_prompts(runner)
    return [
        run(reqs.batch(idx, new, ForwardMode.TARGET_VERIFY)).float().clone()
        for idx, new in VERIFY_STEPS
    ]


@pytest.mark.gpu
@gpu
def test_triton_verify_under_flashinfer_is_as_close_as_flashinfer(tmp_path, monkeypatch):
    """A FlashInfer target (bf16) on CUDA with SGLANG_TRITON_VERIFY=1: its speculative graph
    runner captures the verify buckets with Triton attention (ModelRunner.
    triton_verify_backend). Two correct bf16 kernels differ by rounding, so both are held
    against an fp32 torch_native reference of the same weights: the Triton verify replays'
    largest logit error may be at most twice FlashInfer's own eager forward's (+ 1e-3). A
    wrong mask, position or KV length errs by the size of the logits themselves. (head_dim 64:
    a FlashInfer size.)"""
    pytest.importorskip("flashinfer")
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    monkeypatch.setenv("SGLANG_TRITON_VERIFY", "1")
    # weight_std 0.05: the default 0.5 makes a random model chaotic in bf16 (torch_native's
    # own bf16 logits were off by up to 16 of 38 on CPU; 0.04 of 4 at 0.05)
    model_dir = make_tiny_model_dir(str(tmp_path), hidden=256, heads=4, kv_heads=2, weight_std=0.05)
    kw = dict(device="cuda", max_total_tokens=4096, disable_cuda_graph=True)
    ref_runner = make_scheduler(
        model_dir, dtype="float32", attention_backend="torch_native", **kw
    ).tp_worker.model_runner
    ref = _verify_step_logits(
        ref_runner, lambda mwb: ref_runner.forward_worker_batch(mwb).next_token_logits
    )

    runner = make_scheduler(
        model_dir, dtype="bfloat16", attention_backend="flashinfer", **kw
    ).tp_worker.model_runner
    runner.model.set_eagle3_layers_to_capture()
    mode = CaptureHiddenMode.LAST
    verify = runner.triton_verify_backend(4)
    assert isinstance(verify, TritonAttnBackend) and runner.triton_verify_backend(1) is None
    graphs = CudaGraphRunner(
        runner, mode, max_extend_len=4, batch_sizes=[1, 2, 4, 8],
        verify_backend=verify, verify_backend_max_bs=32,
    )  # fmt: skip
    assert graphs.batches[GraphKey(8, 16)].attn_backend is verify
    assert graphs.backend_of(GraphKey(4, 4)) is runner.attn_backend  # decode keeps FlashInfer
    pairs = []

    def both(mwb):
        eager = runner.forward_worker_batch(mwb, capture_hidden_mode=mode).next_token_logits
        eager = eager.float().clone()
        pairs.append(eager)
        return graphs.replay(mwb).next_token_logits

    replayed = _verify_step_logits(runner, both)
    for step, (r, e, t) in enumerate(zip(ref, pairs, replayed, strict=True)):
        err_flashinfer = (e - r).abs().max().item()
        err_triton = (t - r).abs().max().item()
        scale = r.abs().max().item()
        assert err_triton <= 2 * err_flashinfer + 1e-3, (step, err_triton, err_flashinfer, scale)


# Decode steps over prefill_verify_prompts' five requests: bs 3 in the bs-4 graph (1 pad),
# 5 in 8, 1, 2, then 5 again (KV grows by one token per step and request).
DECODE_STEPS = [
    ([0, 1, 2], [[11], [12], [13]]),
    ([0, 1, 2, 3, 4], [[21], [22], [23], [24], [25]]),
    ([4], [[31]]),
    ([1, 3], [[41], [42]]),
    ([0, 1, 2, 3, 4], [[51], [52], [53], [54], [55]]),
]


@pytest.mark.gpu
@gpu
def test_triton_decode_graphs_under_flashinfer_are_as_close_as_flashinfer(tmp_path, monkeypatch):
    """A FlashInfer target (bf16, head_dim 128, GQA group 4 as in Llama-3.1-8B) on CUDA with
    SGLANG_TRITON_DECODE_GRAPH_MAX_BS=4: its decode graphs of bs 1, 2, 4 capture Triton
    attention (the grouped split-K decode), bs 8 keeps FlashInfer. Both held against an fp32
    torch_native reference of the same weights, as in the verify test above: each replay's
    largest logit error may be at most twice FlashInfer's own eager forward's (+ 1e-3)."""
    pytest.importorskip("flashinfer")
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    monkeypatch.setenv("SGLANG_TRITON_DECODE_GRAPH_MAX_BS", "4")
    model_dir = make_tiny_model_dir(str(tmp_path), hidden=512, heads=4, kv_heads=1, weight_std=0.05)
    kw = dict(device="cuda", max_total_tokens=4096, disable_cuda_graph=True)

    def step_logits(runner, run) -> list[torch.Tensor]:
        reqs = prefill_verify_prompts(runner)
        return [
            run(reqs.batch(idx, new, ForwardMode.DECODE)).float().clone()
            for idx, new in DECODE_STEPS
        ]

    ref_runner = make_scheduler(
        model_dir, dtype="float32", attention_backend="torch_native", **kw
    ).tp_worker.model_runner
    ref = step_logits(
        ref_runner, lambda mwb: ref_runner.forward_worker_batch(mwb).next_token_logits
    )
    runner = make_scheduler(
        model_dir, dtype="bfloat16", attention_backend="flashinfer", **kw
    ).tp_worker.model_runner
    assert runner.triton_decode_graph_max_bs() == 4
    mode = CaptureHiddenMode.NULL
    graphs = CudaGraphRunner(
        runner, mode, max_extend_len=1, batch_sizes=[1, 2, 4, 8],
        verify_backend=TritonAttnBackend(runner), decode_backend_max_bs=4,
    )  # fmt: skip
    assert isinstance(graphs.batches[GraphKey(4, 4)].attn_backend, TritonAttnBackend)
    assert graphs.backend_of(GraphKey(8, 8)) is runner.attn_backend
    pairs = []

    def both(mwb):
        eager = runner.forward_worker_batch(mwb).next_token_logits.float().clone()
        pairs.append(eager)
        return graphs.replay(mwb).next_token_logits

    replayed = step_logits(runner, both)
    for step, (r, e, t) in enumerate(zip(ref, pairs, replayed, strict=True)):
        err_flashinfer = (e - r).abs().max().item()
        err_triton = (t - r).abs().max().item()
        assert err_triton <= 2 * err_flashinfer + 1e-3, (step, err_triton, err_flashinfer)


@pytest.mark.parametrize("mode", [CaptureHiddenMode.NULL, CaptureHiddenMode.LAST])
def test_prefill_buckets_equal_eager_cpu(tiny_model_dir, mode):
    runner, graphs = _cpu_graphs(tiny_model_dir, mode, prefill_max_tokens=32)
    assert graphs.prefill_buckets == [16, 32]
    assert GraphKey(1, 32) in graphs.batches and graphs.max_tokens == 32
    check_prefill_equals_eager(runner, graphs, mode, atol=1e-4)
    # the decode / verify buckets still replay as before
    check_padded_equals_eager(runner, graphs, mode, atol=1e-4)


def check_multi_prefill_equals_eager(runner, graphs: CudaGraphRunner, mode, atol):
    """Prefills of several requests through the prefill buckets (prefill_max_bs 4) equal
    eager prefills: 2 requests of 5 + 7 tokens in bucket (2, 16), 3 of 6 + 9 + 10 in (4, 32)
    with a pad request, and a 12-token chunk after 5 cached tokens next to a new 8-token
    prompt; each request's last-row logits, the KV written and, when captured, every row's
    hidden states (FULL). Steps that would need a gather of rows stay eager: a request that
    does not sample (a mid-prompt chunk), LAST hidden states of several requests; so do more
    requests than the limit and more tokens than the largest bucket."""
    g = torch.Generator().manual_seed(5)
    lens = (5, 7, 6, 9, 10, 17, 8)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in lens]
    reqs = Requests(runner, prompts)
    reqs.batch([5], [prompts[5][:5]], ForwardMode.EXTEND)  # request 5's cached prefix
    cases = [
        ([0, 1], [prompts[0], prompts[1]], GraphKey(2, 16)),
        ([2, 3, 4], [prompts[2], prompts[3], prompts[4]], GraphKey(4, 32)),
        ([5, 6], [prompts[5][5:], prompts[6]], GraphKey(2, 32)),
    ]
    modes = [
        m for m in (CaptureHiddenMode.NULL, CaptureHiddenMode.FULL) if m in graphs.prefill_modes()
    ]
    for idx, new, want_key in cases:
        mwb = replace(reqs.batch(idx, new, ForwardMode.EXTEND), num_logit_rows=[1] * len(idx))
        for m in modes:
            assert graphs.key_for(mwb, m) == want_key
            eager = runner.forward_worker_batch(mwb, capture_hidden_mode=m)
            k_eager = runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc].clone()
            runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc] = 0.0  # written again below
            padded = graphs.replay(mwb, m)
            k_pad = runner.token_to_kv_pool.k_buffer[0][mwb.out_cache_loc]
            torch.testing.assert_close(k_pad, k_eager, atol=atol, rtol=0)
            assert padded.next_token_logits.shape == eager.next_token_logits.shape
            assert padded.next_token_logits.shape[0] == len(idx)
            torch.testing.assert_close(
                padded.next_token_logits, eager.next_token_logits, atol=atol, rtol=0
            )
            if m == CaptureHiddenMode.NULL:
                assert padded.hidden_states is None
            else:
                assert padded.hidden_states.shape[0] == sum(len(t) for t in new)
                torch.testing.assert_close(
                    padded.hidden_states, eager.hidden_states, atol=atol, rtol=0
                )
        if mode == CaptureHiddenMode.LAST:  # several requests' last hidden rows: a gather
            assert not graphs.can_run(mwb, CaptureHiddenMode.LAST)
        chunk = replace(mwb, num_logit_rows=[0] + [1] * (len(idx) - 1))
        assert not graphs.can_run(chunk, modes[0])  # a request that does not sample
    five = reqs.batch([0, 1, 2, 3, 4], [[7, 8]] * 5, ForwardMode.EXTEND)
    assert not graphs.can_run(replace(five, num_logit_rows=[1] * 5), modes[0])  # beyond bs 4
    long = reqs.batch([0, 1], [list(range(20)), list(range(20))], ForwardMode.EXTEND)
    assert not graphs.can_run(replace(long, num_logit_rows=[1, 1]), modes[0])  # beyond 32


@pytest.mark.parametrize("mode", [CaptureHiddenMode.NULL, CaptureHiddenMode.LAST])
def test_multi_request_prefill_buckets_equal_eager_cpu(tiny_model_dir, mode):
    runner, graphs = _cpu_graphs(tiny_model_dir, mode, prefill_max_tokens=32, prefill_max_bs=4)
    assert graphs.prefill_token_buckets == {1: [16, 32], 2: [16, 32], 4: [32]}
    assert graphs.longest_request(GraphKey(4, 32)) == 29
    check_multi_prefill_equals_eager(runner, graphs, mode, atol=1e-4)
    # single-request prefills and the decode / verify buckets replay as before
    check_prefill_equals_eager(runner, graphs, mode, atol=1e-4, max_bs=4)
    check_padded_equals_eager(runner, graphs, mode, atol=1e-4)


def test_prefill_buckets_of_uneven_batch_sizes_cpu(tiny_model_dir):
    """A bs bucket that does not divide the powers of two (3) gets prefill buckets too: its
    capture batch splits 16 tokens as 6 + 5 + 5 (run here eagerly over the padded buffers),
    and 3 requests of 4 + 5 + 6 tokens equal the eager prefill. A single request always
    replays a bs-1 bucket (one lm_head row, as the eager prefill), never a 2-request one."""
    sched = make_scheduler(tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=2048)
    runner = sched.tp_worker.model_runner
    graphs = CudaGraphRunner(
        runner, CaptureHiddenMode.NULL, max_extend_len=1, batch_sizes=[1, 2, 3, 4],
        use_graphs=False, prefill_max_tokens=32, prefill_max_bs=3,
    )  # fmt: skip
    assert graphs.prefill_token_buckets == {1: [16, 32], 2: [16, 32], 3: [16, 32]}
    dummy = graphs._dummy_fill(GraphKey(3, 16))
    assert dummy.extend_seq_lens_cpu == [6, 5, 5]
    graphs._execute(GraphKey(3, 16), dummy)  # the capture batch runs
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (4, 5, 6)]
    reqs = Requests(runner, prompts)
    mwb = replace(reqs.batch([0, 1, 2], prompts, ForwardMode.EXTEND), num_logit_rows=[1, 1, 1])
    assert graphs.key_for(mwb, CaptureHiddenMode.NULL) == GraphKey(3, 16)
    eager = runner.forward_worker_batch(mwb).next_token_logits.clone()
    torch.testing.assert_close(graphs.replay(mwb).next_token_logits, eager, atol=1e-4, rtol=0)
    # bs 1's buckets cut short (as a context length can cut them; the bs-2 buckets reach
    # twice as far): a 20-token prompt then runs eagerly, not in bucket (2, 32)
    one = replace(reqs.batch([0], [list(range(20))], ForwardMode.EXTEND), num_logit_rows=[1])
    assert graphs.key_for(one, CaptureHiddenMode.NULL) == GraphKey(1, 32)
    graphs.token_buckets[1] = [1, 16]
    assert graphs.pick(1, 20) == GraphKey(2, 32)
    assert graphs.key_for(one, CaptureHiddenMode.NULL) is None


def test_static_batches_carry_their_steps_forward_mode(tiny_model_dir):
    """A graph key's static batch says what step it captures: DECODE for one token per
    request, EXTEND for a prefill bucket, TARGET_VERIFY for the target's other multi-token
    keys, DRAFT_EXTEND for the draft runners' catch-ups (backends choose kernels by it:
    TritonAttnBackend's verify-as-decode takes TARGET_VERIFY steps only)."""
    from sglang.srt.speculative.draft_cuda_graph_runner import (
        DraftChainGraphRunner,
        DraftExtendGraphRunner,
    )

    sched = make_scheduler(tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=2048)
    graphs = CudaGraphRunner(
        sched.tp_worker.model_runner, CaptureHiddenMode.NULL, max_extend_len=4,
        batch_sizes=[1, 2], use_graphs=False, prefill_max_tokens=16, prefill_max_bs=2,
    )  # fmt: skip
    assert graphs._static_batch(GraphKey(2, 2)).forward_mode == ForwardMode.DECODE
    assert graphs._static_batch(GraphKey(2, 6)).forward_mode == ForwardMode.TARGET_VERIFY
    assert graphs.is_prefill_key(GraphKey(2, 16))
    assert graphs._static_batch(GraphKey(2, 16)).forward_mode == ForwardMode.EXTEND
    for cls in (DraftExtendGraphRunner, DraftChainGraphRunner):
        assert cls.multi_token_mode == ForwardMode.DRAFT_EXTEND


@pytest.mark.gpu
@gpu
def test_engine_multi_request_prefill_graphs_equal_eager(tiny_model_dir, monkeypatch):
    """--cuda-graph-prefill-max-bs 4 end to end (triton): the same greedy outputs as
    --disable-cuda-graph for four prompts of 5-23 tokens submitted at once, whose prefill
    (56 tokens) replays the multi-request bucket (4, 64) (a review helper found that the first
    version of this test prefilled six prompts, more than the limit, and replayed nothing)."""
    replayed = []
    key_for = CudaGraphRunner.key_for

    def recording(self, mwb, mode):
        key = key_for(self, mwb, mode)
        if key is not None and self.is_prefill_key(key):
            replayed.append((mwb.batch_size, key))
        return key

    monkeypatch.setattr(CudaGraphRunner, "key_for", recording)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 12, 16, 23)]
    lens = [6, 9, 4, 7]
    kw = dict(device="cuda", attention_backend="triton", cuda_graph_bs=[1, 2, 4, 8])
    eager = greedy(tiny_model_dir, prompts, lens, disable_cuda_graph=True, **kw)
    assert replayed == []
    graphs = greedy(
        tiny_model_dir, prompts, lens, cuda_graph_prefill_max_tokens=64,
        cuda_graph_prefill_max_bs=4, **kw,
    )  # fmt: skip
    assert graphs == eager
    assert (4, GraphKey(4, 64)) in replayed


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [CaptureHiddenMode.NULL, CaptureHiddenMode.LAST])
@pytest.mark.parametrize("prefill_max_bs", [1, 4])
def test_cuda_graph_prefill_equals_eager(tiny_model_dir, mode, prefill_max_bs):
    """Captured prefill graphs: single-request ones, and with prefill_max_bs 4 the buckets of
    bs 2 (16, 32) and 4 (32) for prefills of several requests too."""
    runner = _cuda_runner(tiny_model_dir, mode)
    graphs = CudaGraphRunner(
        runner, mode, max_extend_len=4, batch_sizes=[1, 2, 4, 8], prefill_max_tokens=32,
        prefill_max_bs=prefill_max_bs,
    )  # fmt: skip
    assert len(graphs.graphs) == 16 + 2 + (2 + 1 if prefill_max_bs == 4 else 0)
    if prefill_max_bs == 4:
        check_multi_prefill_equals_eager(runner, graphs, mode, atol=2e-4)
    check_prefill_equals_eager(runner, graphs, mode, atol=2e-4, max_bs=prefill_max_bs)
    check_padded_equals_eager(runner, graphs, mode, atol=2e-4)


@pytest.mark.gpu
@gpu
def test_engine_prefill_graphs_equal_eager(tiny_model_dir):
    """--cuda-graph-prefill-max-tokens 32 end to end (triton): the same greedy outputs as
    --disable-cuda-graph, prompts of 5-40 tokens arriving one per step."""
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 12, 16, 23, 32, 40)]
    lens = [6, 9, 4, 7, 5, 8]
    kw = dict(device="cuda", attention_backend="triton", cuda_graph_bs=[1, 2, 4, 8])
    eager = greedy(tiny_model_dir, prompts, lens, disable_cuda_graph=True, **kw)
    graphs = greedy(tiny_model_dir, prompts, lens, cuda_graph_prefill_max_tokens=32, **kw)
    assert graphs == eager


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [CaptureHiddenMode.NULL, CaptureHiddenMode.LAST])
def test_cuda_graph_replay_equals_eager(tiny_model_dir, mode):
    runner = _cuda_runner(tiny_model_dir, mode)
    graphs = CudaGraphRunner(runner, mode, max_extend_len=4, batch_sizes=[1, 2, 4, 8])
    assert len(graphs.graphs) == 16
    check_padded_equals_eager(runner, graphs, mode, atol=2e-4)


@pytest.mark.gpu
@gpu
def test_cuda_graph_verify_longer_than_one_query_block(tiny_model_dir):
    """A verify of 40 + 1 tokens replays bucket (2, 42), 21 tokens per request on average:
    the Triton extend kernel must still cover the 40-token request (its grid of 32-query
    blocks is sized from the longest request a bucket holds, not from the average)."""
    runner = _cuda_runner(tiny_model_dir, CaptureHiddenMode.NULL)
    graphs = CudaGraphRunner(runner, CaptureHiddenMode.NULL, max_extend_len=40, batch_sizes=[2])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (6, 9)]
    reqs = Requests(runner, prompts)
    runner.forward_worker_batch(reqs.batch([0, 1], prompts, ForwardMode.EXTEND))
    new = [torch.randint(5, 500, (40,), generator=g).tolist(), [7]]
    mwb = reqs.batch([0, 1], new, ForwardMode.TARGET_VERIFY)
    assert graphs.pick(2, 41) == GraphKey(2, 42)
    eager = runner.forward_worker_batch(mwb)
    padded = graphs.replay(mwb)
    torch.testing.assert_close(padded.next_token_logits, eager.next_token_logits, atol=2e-4, rtol=0)


def greedy(model_dir: str, prompts, lens, **kw) -> dict[str, list[int]]:
    kw.setdefault("dtype", "float32")
    sched = make_scheduler(model_dir, max_total_tokens=8192, **kw)
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        submit(sched, f"r{i}", p, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    out: dict[str, dict] = {}
    run_until_idle(sched, out)
    return {rid: o["output_ids"] for rid, o in out.items()}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_engine_graphs_equal_eager_while_batch_shrinks(tiny_model_dir, backend, tmp_path):
    if backend == "flashinfer":  # head_dim 64: a flashinfer kernel size
        pytest.importorskip("flashinfer")
        tiny_model_dir = make_tiny_model_dir(str(tmp_path), hidden=256, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in range(4, 36)]
    lens = [4 + (i % 12) * 3 for i in range(32)]  # 32 running -> 12 -> ... as requests finish
    kw = dict(device="cuda", attention_backend=backend, cuda_graph_bs=[1, 2, 4, 8, 16, 32])
    if backend == "flashinfer":
        kw["dtype"] = "bfloat16"
    eager = greedy(tiny_model_dir, prompts, lens, disable_cuda_graph=True, **kw)
    graphs = greedy(tiny_model_dir, prompts, lens, **kw)
    assert {r: len(v) for r, v in graphs.items()} == {f"r{i}": n for i, n in enumerate(lens)}
    same = sum(graphs[r] == eager[r] for r in eager)
    assert same == len(eager) if backend == "triton" else same >= len(eager) - 2


def prefilled_draft(tiny_model_dir, tmp_path, device: str, dtype: str, backend, seed: int):
    """An EAGLE-3 scheduler (K = 3, eager) with three prompts (6, 9, 4 tokens) prefilled, so
    the target and draft KV of the prompts are in place. Returns (scheduler, its running
    requests by rid, the DraftRunner, the random generator used)."""
    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

    draft_dir = make_tiny_eagle3_dir(str(tmp_path / "eagle3"), tiny_model_dir)
    sched = make_scheduler(
        tiny_model_dir, device=device, dtype=dtype, max_total_tokens=4096,
        speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_dir,
        speculative_num_steps=3, disable_cuda_graph=True,
        # no worker thread: a step it runs while graphs are captured would invalidate the
        # capture (CUDA's global capture mode)
        disable_overlap_schedule=True,
        **({"attention_backend": backend} if backend else {}),
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate((6, 9, 4)):
        submit(sched, f"r{i}", torch.randint(5, 500, (n,), generator=g).tolist(), {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})  # fmt: skip
    sched.step()  # prefill: target KV and draft KV of the prompts
    return sched, sorted(sched.running, key=lambda r: r.rid), sched.tp_worker.draft, g


def check_draft_padded_equals_eager(tiny_model_dir, tmp_path, device: str, use_graphs: bool):
    from sglang.srt.speculative.draft_cuda_graph_runner import DraftDecodeGraphRunner

    backend = "triton" if device == "cuda" else None
    sched, reqs, draft, g = prefilled_draft(tiny_model_dir, tmp_path, device, "float32", backend, 3)
    graphs = DraftDecodeGraphRunner(draft, [1, 2, 4, 8], use_graphs=use_graphs)
    hd = draft.model.config.hidden_size
    for step in range(2):
        slots = sched.allocator.alloc(len(reqs))
        pos = [r.kv_len + step for r in reqs]
        for r, p, s in zip(reqs, pos, slots, strict=True):
            sched.req_to_token_pool.write(r.req_pool_idx, p, s.view(1))
        ids = torch.randint(5, 500, (len(reqs),), generator=g).to(device)
        hidden = torch.randn(len(reqs), hd, generator=g).to(device)
        rows = [r.req_pool_idx for r in reqs]
        want = draft.forward(ids, hidden, rows, pos, [1] * len(reqs), slots)
        k_want = draft.kv_pool.k_buffer[0][slots.to(device)].clone()
        got = graphs.decode(ids, hidden, rows, pos, slots)  # 3 rows in the bs-4 bucket
        torch.testing.assert_close(draft.kv_pool.k_buffer[0][slots.to(device)], k_want)
        torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=2e-4, rtol=0)
    assert graphs.can_run_decode(8) and not graphs.can_run_decode(9)


def test_draft_decode_padded_equals_eager_cpu(tiny_model_dir, tmp_path):
    check_draft_padded_equals_eager(tiny_model_dir, tmp_path, "cpu", use_graphs=False)


@pytest.mark.gpu
@gpu
def test_draft_decode_cuda_graph_equals_eager(tiny_model_dir, tmp_path):
    check_draft_padded_equals_eager(tiny_model_dir, tmp_path, "cuda", use_graphs=True)


def check_draft_extend_padded_equals_eager(tiny_model_dir, tmp_path, device, use_graphs, backend):
    """Catch-up draft extends of ragged lengths (1, 3, 2: three requests in the bs-4 bucket,
    then one request of 4 tokens) through DraftExtendGraphRunner equal DraftRunner.forward:
    the last row's logits and hidden state, and the draft KV written. The decode runner built
    after it on the same backend (as DraftRunner.init_cuda_graphs does) still replays."""
    from sglang.srt.speculative.draft_cuda_graph_runner import (
        DraftDecodeGraphRunner,
        DraftExtendGraphRunner,
    )

    dtype = "bfloat16" if backend == "flashinfer" else "float32"
    sched, reqs, draft, g = prefilled_draft(tiny_model_dir, tmp_path, device, dtype, backend, 5)
    extend = DraftExtendGraphRunner(draft, [1, 2, 4, 8], 4, use_graphs=use_graphs)
    decode = DraftDecodeGraphRunner(draft, [1, 2, 4, 8], use_graphs=use_graphs)
    width = 3 * draft.model.target_hidden_size
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == "bfloat16" else dict(atol=2e-4, rtol=0)
    done = [0] * len(reqs)  # catch-up tokens written per request so far
    for lens in ([1, 3, 2], [4, 0, 0]):
        rows = [i for i, n in enumerate(lens) if n]
        ext = [lens[i] for i in rows]
        pre = [reqs[i].kv_len + done[i] for i in rows]
        slots = sched.allocator.alloc(sum(ext))
        k = 0
        for i, p, n in zip(rows, pre, ext, strict=True):
            sched.req_to_token_pool.write(reqs[i].req_pool_idx, p, slots[k : k + n])
            k += n
            done[i] += n
        ids = torch.randint(5, 500, (sum(ext),), generator=g).to(device)
        hidden = torch.randn(sum(ext), width, generator=g).to(device, getattr(torch, dtype))
        pools = [reqs[i].req_pool_idx for i in rows]
        assert extend.fits(ext)
        want = draft.forward(ids, hidden, pools, pre, ext, slots)
        k_want = draft.kv_pool.k_buffer[0][slots.to(device)].clone()
        got = extend.extend(ids, hidden, pools, pre, ext, slots)
        torch.testing.assert_close(draft.kv_pool.k_buffer[0][slots.to(device)], k_want, **tol)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
    assert not extend.fits([5]) and not extend.fits([1] * 9)
    # the decode runner over the same (shared) attention buffers
    slots = sched.allocator.alloc(len(reqs))
    pos = [r.kv_len + n for r, n in zip(reqs, done, strict=True)]
    for r, p, s in zip(reqs, pos, slots, strict=True):
        sched.req_to_token_pool.write(r.req_pool_idx, p, s.view(1))
    ids = torch.randint(5, 500, (len(reqs),), generator=g).to(device)
    hd = draft.model.config.hidden_size
    hidden = torch.randn(len(reqs), hd, generator=g).to(device, getattr(torch, dtype))
    rows = [r.req_pool_idx for r in reqs]
    want = draft.forward(ids, hidden, rows, pos, [1] * len(reqs), slots)
    got = decode.decode(ids, hidden, rows, pos, slots)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)


def test_draft_extend_padded_equals_eager_cpu(tiny_model_dir, tmp_path):
    check_draft_extend_padded_equals_eager(tiny_model_dir, tmp_path, "cpu", False, None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_draft_extend_cuda_graph_equals_eager(tiny_model_dir, tmp_path, backend):
    if backend == "flashinfer":  # head_dim 64: a flashinfer kernel size
        pytest.importorskip("flashinfer")
        tiny_model_dir = make_tiny_model_dir(str(tmp_path), hidden=256, heads=4, kv_heads=2)
    check_draft_extend_padded_equals_eager(tiny_model_dir, tmp_path, "cuda", True, backend)


@pytest.mark.gpu
@gpu
def test_spec_engine_graphs_equal_eager(tiny_model_dir, tmp_path):
    """Static K = 3 speculation on CUDA (Triton attention, float32): with CUDA graphs (target
    verify, draft catch-up extend, draft decode steps, whole-chain drafting) the outputs equal
    the eager run and the plain engine's, and every proposal equals the eager run's; the
    catch-up or chain graphs ran."""
    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

    draft_dir = make_tiny_eagle3_dir(str(tmp_path / "eagle3"), tiny_model_dir)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30, 12)]
    lens = [12, 20, 7, 16, 25]
    kw = dict(device="cuda", attention_backend="triton", cuda_graph_bs=[1, 2, 4, 8])
    plain = greedy(tiny_model_dir, prompts, lens, **kw)

    def run(disable: bool):
        sched = make_scheduler(
            tiny_model_dir, dtype="float32", max_total_tokens=8192, disable_cuda_graph=disable,
            speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_dir,
            speculative_num_steps=3, **kw,
        )  # fmt: skip
        worker, replays = sched.tp_worker, {"graph": 0}
        proposals = record_step_proposals(worker)
        for runner, name in (
            (worker.draft.extend_graph_runner, "extend"),
            (worker.draft.chain_graph_runner, "draft"),  # whole greedy drafting steps
        ):
            if runner is not None:
                count_calls(runner, name, replays, "graph")
        for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
            submit(sched, f"r{i}", p, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        out: dict[str, dict] = {}
        run_until_idle(sched, out)
        sched.kv.check_accounting()
        return {rid: o["output_ids"] for rid, o in out.items()}, proposals, replays["graph"]

    eager, eager_props, eager_replays = run(True)
    graphs, graph_props, graph_replays = run(False)
    assert eager == graphs == plain
    assert graph_props == eager_props and len(graph_props) >= 5
    assert eager_replays == 0 and graph_replays >= 5


def test_fast_path_flag_validation(tiny_model_dir):
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_args_resolve import resolve_server_args

    for kw, flag in [
        ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs"),
        ({"cuda_graph_bs": [0, 4]}, "--cuda-graph-bs"),
        ({"cuda_graph_prefill_max_tokens": -1}, "--cuda-graph-prefill-max-tokens"),
        ({"cuda_graph_prefill_max_tokens": 4097}, "--cuda-graph-prefill-max-tokens"),
        ({"cuda_graph_prefill_max_bs": 0}, "--cuda-graph-prefill-max-bs must be >= 1, got 0"),
        ({"attention_backend": "flashinfer", "device": "cpu"}, "torch_native"),
    ]:
        with pytest.raises(ValueError, match=flag):
            resolve_server_args(ServerArgs(model_path=tiny_model_dir, **kw))


def test_prefill_graph_default_by_device(tiny_model_dir, monkeypatch):
    """--cuda-graph-prefill-max-tokens left out: DEFAULT_PREFILL_GRAPH_TOKENS on CUDA, 0 (no
    graphs) on CPU and where --cuda-graph-bs leaves out batch size 1 (the buckets need it; a
    value given there keeps its warning); a given value, 0 included, is kept."""
    from sglang.srt.server_args import DEFAULT_PREFILL_GRAPH_TOKENS, ServerArgs
    from sglang.srt.server_args_resolve import resolve_server_args

    def resolved(device: str, **kw) -> int:
        args = ServerArgs(model_path=tiny_model_dir, device=device, **kw)
        return resolve_server_args(args).cuda_graph_prefill_max_tokens

    assert resolved("cpu") == 0
    assert resolved("cpu", cuda_graph_prefill_max_tokens=64) == 64
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve only, no GPU use
    assert resolved("cuda") == DEFAULT_PREFILL_GRAPH_TOKENS == 512
    assert resolved("cuda", cuda_graph_prefill_max_tokens=0) == 0
    assert resolved("cuda", cuda_graph_bs=[8, 16]) == 0
    assert resolved("cuda", cuda_graph_bs=[1, 8]) == 512
    assert resolved("cuda", cuda_graph_bs=[8, 16], cuda_graph_prefill_max_tokens=64) == 64


@pytest.mark.parametrize("spec", [False, True])
def test_engine_with_prefill_buckets_equals_eager_cpu(tiny_model_dir, draft_dir, spec):
    """Greedy outputs of a scheduler whose target runner replays prefills through the prefill
    buckets (padded static batch, run eagerly on CPU) equal a scheduler's without graphs:
    plain, and EAGLE-3 (K = 3), whose prefill takes every row's hidden states (FULL) for the
    draft extend. Prompts of 5-40 tokens: those up to 32 replay bucket 16 or 32, longer ones
    and multi-request prefills run eagerly. The 12-token prompt comes again at the end: fully
    cached, its prefill computes its last token only, which a decode bucket replays (with
    EAGLE-3 too: it asks FULL of the LAST graphs, the same rows)."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 12, 16, 23, 32, 40)]
    prompts.append(prompts[1])
    lens = [6, 9, 4, 7, 5, 8, 9]
    kw = dict(device="cpu", dtype="float32", max_total_tokens=4096)
    if spec:
        kw |= dict(
            speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_dir,
            speculative_num_steps=3,
        )  # fmt: skip

    def run(with_graphs: bool) -> tuple[dict[str, list[int]], int]:
        sched = make_scheduler(tiny_model_dir, **kw)
        runner, used = sched.tp_worker.model_runner, [0]
        if with_graphs:
            mode = CaptureHiddenMode.LAST if spec else CaptureHiddenMode.NULL
            graphs = CudaGraphRunner(
                runner, mode, 4 if spec else 1, [1, 2, 4, 8], use_graphs=False,
                prefill_max_tokens=32,
            )  # fmt: skip
            real = graphs.replay

            def replay(mwb, *a):
                used[0] += mwb.forward_mode == ForwardMode.EXTEND
                return real(mwb, *a)

            graphs.replay = replay
            runner.cuda_graph_runner = graphs
        out: dict[str, dict] = {}
        for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
            if i == len(prompts) - 1:
                run_until_idle(sched, out)  # the repeated prompt's first run is cached
            submit(sched, f"r{i}", p, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            sched.step()  # one request per prefill: each can take a prefill bucket
        run_until_idle(sched, out)
        assert sched.stats["cached_tokens"] == len(prompts[1]) - 1
        pool = runner.hidden_pool
        rows = pool.buffer[1:].clone() if pool is not None else None  # row 0: padding's slot
        counts = runner.forward_counters.steps  # ForwardCounters: (kind, path) -> steps
        if with_graphs:  # the runner's own count of its paths agrees with the replays seen
            assert counts["prefill", "graph"] == used[0] and counts["prefill", "eager"] == 1
            assert counts["decode", "eager"] == 0 and counts["decode", "graph"] > 0
        else:
            assert counts["prefill", "graph"] == counts["decode", "graph"] == 0
        return {rid: o["output_ids"] for rid, o in out.items()}, used[0], rows

    eager, _, eager_pool = run(False)
    replayed, prefills, replayed_pool = run(True)
    assert replayed == eager
    if spec:  # the random draft accepts nothing: the hidden states the draft reads, compared
        torch.testing.assert_close(replayed_pool, eager_pool, atol=1e-4, rtol=1e-5)
    assert {r: len(v) for r, v in eager.items()} == {f"r{i}": n for i, n in enumerate(lens)}
    assert prefills == 6  # every prompt but the 40-token one
    assert eager["r6"] == eager["r1"]  # the same prompt, greedy
