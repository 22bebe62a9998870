"""Edge cases of the single-request prefill buckets (--cuda-graph-prefill-max-tokens), through
the CPU hook of test_cuda_graph_runner.py: the target runner replays its padded static batches
eagerly (use_graphs=False), and a scheduler with it must give what a scheduler without it
gives: the same tokens (greedy, and sampled with a fixed seed), the same logprobs within float
tolerance, the same finish reasons and cached-token counts, and, with EAGLE-3, the same draft
proposals (the draft reads the prefill's FULL hidden states, which greedy outputs alone would
not check). Each case also checks that the prefill buckets were used.

Plus the capture's dummy batches: a prefill bucket must not run past the model's context
length (see test_prefill_buckets_stay_within_the_context_length).
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang.srt.managers.io_struct import BatchStrOut, TokenizedGenerateReqInput
from sglang.srt.managers.request_validation import build_sampling_params
from sglang.srt.model_executor.cuda_graph_buckets import prefill_token_buckets
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.eagle_worker_v2 import drafts_by_request
from sglang.test.scheduler_utils import abort, make_scheduler

K = 3
G = {"temperature": 0, "ignore_eos": True}


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lens]


def one_per_step(
    ps: list[list[int]], lens: list[int], params=G, gap: int = 0, **extra
) -> list[list[tuple]]:
    """Each request arrives alone in its own step (so its prefill can take a bucket), `gap`
    empty steps after each (so that its prompt chunks run alone too)."""
    out = []
    for i, (p, n) in enumerate(zip(ps, lens, strict=True)):
        out += [[("submit", f"r{i}", p, {**params, "max_new_tokens": n}, extra)]] + [[]] * gap
    return out


def _collect(sched, out: dict) -> None:
    for msg in sched.outputs.local_outbox:
        if not isinstance(msg, BatchStrOut):
            continue
        for i, rid in enumerate(msg.rids):
            o = out.setdefault(rid, {"ids": [], "lp": [], "top": [], "in_lp": [], "in_top": []})
            o["ids"] += msg.output_ids_delta[i]
            o["lp"] += list(msg.output_token_logprobs_delta[i] or [])
            o["top"] += list(msg.output_top_logprobs_delta[i] or [])
            o["in_lp"] += list(msg.input_token_logprobs[i] or [])
            o["in_top"] += list(msg.input_top_logprobs[i] or [])
            o["cached"] = msg.meta[i]["cached_tokens"]
            o["finish"] = msg.finished_reason[i]
    sched.outputs.local_outbox.clear()


def serve(
    model_dir, schedule, graphs: bool, spec_kw=None, prefill_max_tokens=32, hook=None,
    prefill_max_bs=1, **kw,
):  # fmt: skip
    """Run `schedule` (per step, actions ("submit", rid, ids, params, extra) / ("abort", rid))
    then until idle. Returns (outputs by rid, draft proposals, the extend lens of each prefill
    the padded runner replayed). prefill_max_bs: --cuda-graph-prefill-max-bs."""
    args = dict(device="cpu", dtype="float32", max_total_tokens=4096) | kw | (spec_kw or {})
    sched = make_scheduler(model_dir, **args)
    runner, replayed = sched.tp_worker.model_runner, []
    if graphs:
        mode = CaptureHiddenMode.LAST if spec_kw else CaptureHiddenMode.NULL
        runner.cuda_graph_runner = g = CudaGraphRunner(
            runner, mode, K + 1 if spec_kw else 1, [1, 2, 4, 8], use_graphs=False,
            prefill_max_tokens=prefill_max_tokens, prefill_max_bs=prefill_max_bs,
        )  # fmt: skip
        real_replay = g.replay

        def replay(mwb, *a):
            if mwb.forward_mode == ForwardMode.EXTEND:
                replayed.append(list(mwb.extend_seq_lens))
            return real_replay(mwb, *a)

        g.replay = replay
    drafts: list[tuple] = []
    if spec_kw:  # every drafting request's proposals, by request slot and position
        worker = sched.tp_worker
        real_draft = worker.draft_tokens

        def draft_tokens(mwb):
            d, q = real_draft(mwb)
            for r, pos, ds in zip(
                mwb.req_pool_indices,
                mwb.extend_prefix_lens,
                drafts_by_request(d, mwb.spec.draft_lens),
                strict=True,
            ):
                if ds:
                    drafts.append((r, pos, tuple(ds)))
            return d, q

        worker.draft_tokens = draft_tokens
    if hook is not None:
        hook(sched)
    out: dict[str, dict] = {}
    for actions in schedule:
        for a in actions:
            if a[0] == "abort":
                abort(sched, a[1])
                continue
            _, rid, ids, params, extra = a
            sp = build_sampling_params(params, sched.tokenizer, sched.model_config)
            sched.handle_message(
                TokenizedGenerateReqInput(
                    rid, None, ids, sp, extra.get("return_logprob", False),
                    extra.get("logprob_start_len", -1), extra.get("top_logprobs_num", 0),
                    False, extra.get("seed", 0),
                )
            )  # fmt: skip
        sched.step()
        _collect(sched, out)
    for _ in range(2000):
        if sched.is_idle():
            break
        sched.step()
        _collect(sched, out)
    _collect(sched, out)
    assert sched.is_idle()
    return out, drafts, replayed


def assert_same(eager: dict, padded: dict) -> None:
    assert padded.keys() == eager.keys()
    for rid, e in eager.items():
        p = padded[rid]
        assert p["ids"] == e["ids"], rid
        assert (p["finish"], p["cached"]) == (e["finish"], e["cached"]), rid
        for k in ("lp", "in_lp"):
            assert [t for _, t in p[k]] == [t for _, t in e[k]], (rid, k)
            want = [v if v is not None else float("nan") for v, _ in e[k]]
            got = [v if v is not None else float("nan") for v, _ in p[k]]
            torch.testing.assert_close(
                torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0, equal_nan=True
            )
        for k in ("top", "in_top"):
            assert len(p[k]) == len(e[k]), (rid, k)
            for a, b in zip(p[k], e[k], strict=True):
                assert (a is None) == (b is None), (rid, k)
                if a is not None:
                    assert [t for _, t in a] == [t for _, t in b], (rid, k)
                    torch.testing.assert_close(
                        torch.tensor([v for v, _ in a]), torch.tensor([v for v, _ in b]),
                        atol=1e-4, rtol=0,
                    )  # fmt: skip


def compare(model_dir, schedule, **kw) -> tuple[dict, list, list]:
    eager, eager_drafts, _ = serve(model_dir, schedule, graphs=False, **kw)
    padded, padded_drafts, replayed = serve(model_dir, schedule, graphs=True, **kw)
    assert_same(eager, padded)
    assert padded_drafts == eager_drafts
    return eager, eager_drafts, replayed


# ---------------------------------------------------------------- plain serving


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_chunks_take_buckets(tiny_model_dir, overlap):
    """--chunked-prefill-size 8: every chunk (sampling or not) of prompts of 1, 16, 17, 32, 33
    and 40 tokens replays a bucket (the non-final chunks have no logits rows); with and
    without overlap scheduling."""
    lens = [1, 16, 17, 32, 33, 40]
    schedule = one_per_step(prompts(1, lens), [4, 5, 3, 4, 3, 4], gap=2)
    kw = dict(chunked_prefill_size=8, disable_overlap_schedule=not overlap)
    out, _, replayed = compare(tiny_model_dir, schedule, **kw)
    assert [len(out[f"r{i}"]["ids"]) for i in range(6)] == [4, 5, 3, 4, 3, 4]
    assert replayed.count([8]) >= 12 and [1] in replayed


def test_exact_bucket_sizes_and_one_token_prompts(tiny_model_dir):
    """Prompts of exactly a bucket (16, 32), one past it (17: bucket 32; 33: eager), a 1-token
    prompt (the decode bucket) and a token count below the smallest bucket (5: bucket 16)."""
    lens = [16, 17, 32, 33, 1, 5]
    _, _, replayed = compare(tiny_model_dir, one_per_step(prompts(2, lens), [3] * 6))
    assert replayed == [[16], [17], [32], [1], [5]]


def test_radix_prefix_hits(tiny_model_dir):
    """A 60-token prompt (eager), then prompts sharing its prefix: 3 and 20 uncached tokens
    replay buckets, the same prompt again computes its last token only."""
    base = prompts(3, [60])[0]
    wait = [[]] * 6  # the first request finishes (its prompt enters the cache)
    schedule = [
        [("submit", "a", base, {**G, "max_new_tokens": 4}, {})],
        *wait,
        [("submit", "b", base + [7, 8, 9], {**G, "max_new_tokens": 4}, {})],
        *wait,
        [("submit", "c", base[:50] + list(range(20, 40)), {**G, "max_new_tokens": 4}, {})],
        *wait,
        [("submit", "d", base, {**G, "max_new_tokens": 4}, {})],
    ]
    out, _, replayed = compare(tiny_model_dir, schedule)
    assert [out[r]["cached"] for r in "abcd"] == [0, 60, 50, 59]
    assert replayed == [[3], [20], [1]]


def test_logprobs(tiny_model_dir):
    """Output logprobs with top-3 replay buckets; input logprobs from logprob_start_len 12 in
    chunks of 4: the chunks before it (no input rows) replay, the others stay eager; a
    prompt of 1 token with logprob_start_len 0 (nothing to score)."""
    ps = prompts(4, [16, 24, 1])
    schedule = one_per_step(ps[:1], [4], return_logprob=True, top_logprobs_num=3)
    for i, p in enumerate(ps[1:]):
        extra = dict(return_logprob=True, logprob_start_len=12 if i == 0 else 0, top_logprobs_num=2)
        schedule.append([("submit", f"s{i}", p, {**G, "max_new_tokens": 3}, extra)])
    out, _, replayed = compare(tiny_model_dir, schedule, chunked_prefill_size=4)
    assert len(out["r0"]["top"]) == 4 and len(out["r0"]["top"][0]) == 3
    assert len(out["s0"]["in_lp"]) == 24 - 12
    assert replayed.count([4]) == 4 + 3  # r0's 4 chunks, s0's chunks before position 12


def test_sampling_with_a_seed(tiny_model_dir):
    """temperature > 0 with top-p and a repetition penalty, fixed seeds: the same tokens (the
    sampled row's logits are the eager ones), with output logprobs."""
    params = {"temperature": 0.9, "top_p": 0.9, "repetition_penalty": 1.2, "ignore_eos": True}
    ps = prompts(5, [12, 20])
    schedule = [
        [("submit", f"r{i}", p, {**params, "max_new_tokens": 4}, dict(seed=7 + i))]
        for i, p in enumerate(ps)
    ]
    _, _, replayed = compare(tiny_model_dir, schedule)
    assert replayed == [[12], [20]]


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_right_after_the_prefill_launch(tiny_model_dir, overlap):
    """A request aborted in the step after its prefill was launched (with overlap: while it is
    in flight), one aborted between two of its chunks, then a request that runs to the end."""
    ps = prompts(6, [16, 20, 24])
    schedule = [
        [("submit", "a", ps[0], {**G, "max_new_tokens": 8}, {})],
        [("abort", "a"), ("submit", "b", ps[1], {**G, "max_new_tokens": 8}, {})],
        [("abort", "b")],
        [("submit", "c", ps[2], {**G, "max_new_tokens": 5}, {})],
    ]
    kw = dict(chunked_prefill_size=12, disable_overlap_schedule=not overlap)
    out, _, replayed = compare(tiny_model_dir, schedule, **kw)
    assert out["a"]["finish"]["type"] == out["b"]["finish"]["type"] == "abort"
    assert len(out["c"]["ids"]) == 5 and [12] in replayed


# ---------------------------------------------------------------- EAGLE-3


def spec(draft_dir, **kw) -> dict:
    return dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=K,
        **kw,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_eagle3_chunked_prefill(tiny_model_dir, draft_dir, overlap):
    """Static K = 3, chunks of 5: a chunk of 3 (<= K + 1: a verify bucket) and of 5 (bucket
    16), sampling or not; the draft extend reads every row's hidden states; the drafts match."""
    lens = [8, 13, 1, 3]
    schedule = one_per_step(prompts(7, lens), [6, 6, 4, 6], gap=3)
    kw = dict(chunked_prefill_size=5, disable_overlap_schedule=not overlap)
    _, drafts, replayed = compare(tiny_model_dir, schedule, spec_kw=spec(draft_dir), **kw)
    assert drafts and [3] in replayed and [5] in replayed


def test_eagle3_adaptive_with_a_prefix_hit(tiny_model_dir, draft_dir):
    """--speculative-adaptive, a second prompt sharing the first one's prefix (its uncached
    part replays a bucket). The step-time model stays at its prior and the guard is off, so
    both runs choose the same draft lengths (online, they follow measured times, and the two
    runs drafted at different steps under CI load)."""
    base = prompts(8, [40])[0]
    schedule = [
        [("submit", "a", base, {**G, "max_new_tokens": 6}, {})],
        *[[]] * 8,
        [("submit", "b", base + [11, 12, 13, 14, 15, 16], {**G, "max_new_tokens": 6}, {})],
    ]
    fixed = json.dumps({"online_correction": False, "guard": False})
    kw = dict(spec_kw=spec(draft_dir, speculative_adaptive=True, speculative_adaptive_config=fixed))
    out, drafts, replayed = compare(tiny_model_dir, schedule, **kw)
    assert out["b"]["cached"] > 0 and replayed and drafts


def test_eagle3_deferred_draft_extend(tiny_model_dir, draft_dir):
    """Prefills while speculation is off defer their draft extend (every row's hidden states
    stay pending, FULL from the bucket); drafting resumes later and consumes them: the same
    drafts as eager prefills give. Overlap scheduling, chunks of 8."""

    def speculation_off_at_first(sched) -> None:
        s, steps = sched.spec, {"n": 0}
        base_choose = s.choose_draft_lens
        off = lambda: steps["n"] < 12  # noqa: E731
        s.takes_target_only_prefix = off

        def choose(reqs):
            steps["n"] += 1
            return [0] * len(reqs) if off() else base_choose(reqs)

        s.choose_draft_lens = choose

    schedule = one_per_step(prompts(9, [12, 20, 4]), [24, 24, 24], gap=2)
    kw = dict(chunked_prefill_size=8, disable_overlap_schedule=False)
    kw |= dict(spec_kw=spec(draft_dir), hook=speculation_off_at_first)
    _, drafts, replayed = compare(tiny_model_dir, schedule, **kw)
    assert drafts and [8] in replayed


def test_adaptive_prefills_replay_the_buckets_plain_prefills_replay(tiny_model_dir, draft_dir):
    """An adaptive server whose policy never drafts (overlap on, prefill graphs of up to 4
    requests and 64 tokens) replays a prefill bucket for exactly the prefills a server without
    speculation replays, and gives the same greedy tokens. (On the H200 the adaptive server's
    prefill steps launched 1-6 ms slower than the plain one's, thirty-sixth session: this
    rules out that its target prefills leave the graphs, on the path both take on the CPU.)"""
    ps = prompts(12, [9, 14, 20, 7, 30, 12, 18, 25])
    schedule = [
        [("submit", f"r{i}", ps[i], {**G, "max_new_tokens": 12}, {}) for i in (0, 1, 2)],
        *[[]] * 3,
        [("submit", f"r{i}", ps[i], {**G, "max_new_tokens": 10}, {}) for i in (3, 4)],
        [],
        [("submit", "r5", ps[5], {**G, "max_new_tokens": 8}, {})],
        *[[]] * 4,
        [("submit", f"r{i}", ps[i], {**G, "max_new_tokens": 9}, {}) for i in (6, 7)],
    ]
    never = json.dumps({"time_model": {"verify_tokens": 1.0}, "online_correction": False})
    adaptive = spec(draft_dir, speculative_adaptive=True, speculative_adaptive_config=never)
    kw = dict(graphs=True, prefill_max_tokens=64, prefill_max_bs=4, disable_overlap_schedule=False)
    plain_out, _, plain_replayed = serve(tiny_model_dir, schedule, **kw)
    spec_out, drafts, spec_replayed = serve(tiny_model_dir, schedule, spec_kw=adaptive, **kw)
    assert not drafts  # the policy never drafted
    assert {r: o["ids"] for r, o in spec_out.items()} == {r: o["ids"] for r, o in plain_out.items()}
    assert spec_replayed == plain_replayed
    assert any(len(lens) > 1 for lens in plain_replayed)  # multi-request prefill buckets too
    assert sum(len(lens) for lens in plain_replayed) == len(ps)  # every prefill replayed


# ---------------------------------------------------------------- capture


def test_prefill_buckets_stay_within_the_context_length(tiny_model_dir):
    """The capture runs each bucket's dummy batch (one request of the bucket's whole token
    count, positions 0..T - 1): a bucket longer than the model's context length indexes the
    RoPE cache and the request's req_to_token row (context length + 8 wide) out of range.
    No prefill can compute more tokens than the context length, so no bucket is longer.
    Here: context length 100, P = 128 -> buckets 16, 32, 64 (not 128); every dummy batch
    runs (what the capture runs, eagerly)."""
    sched = make_scheduler(
        tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=1024, context_length=100
    )
    runner = sched.tp_worker.model_runner
    for mode, ext in [(CaptureHiddenMode.NULL, 1), (CaptureHiddenMode.LAST, 4)]:
        graphs = CudaGraphRunner(
            runner, mode, ext, [1, 2], use_graphs=False, prefill_max_tokens=128
        )
        for key in graphs.keys:
            fb = graphs._dummy_fill(key)
            out = graphs._execute(key, fb)
            # a prefill bucket: the last row's logits only, every row's hidden states
            rows = 1 if graphs.is_prefill_key(key) else key.num_tokens
            assert out.next_token_logits.shape[0] == rows
            if mode == CaptureHiddenMode.LAST:
                assert out.hidden_states.shape[0] == key.num_tokens
        assert graphs.prefill_buckets == [16, 32, 64]
    assert prefill_token_buckets(128, 4, limit=100) == [16, 32, 64]
    assert prefill_token_buckets(128, 4, limit=128) == [16, 32, 64, 128]
    assert prefill_token_buckets(20, 4, limit=16) == [16]


def test_prefill_buckets_stop_at_the_chunk_size_and_need_bs_1(tiny_model_dir, caplog):
    """A prompt longer than --chunked-prefill-size is prefilled in chunks of at most that
    many tokens, so buckets stop at the first one that holds a chunk (longer ones would never
    replay); a batch-size list without 1 has no prefill buckets, and says so."""
    sched = make_scheduler(
        tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=1024,
        chunked_prefill_size=40,
    )  # fmt: skip
    runner = sched.tp_worker.model_runner
    graphs = CudaGraphRunner(
        runner, CaptureHiddenMode.NULL, 1, [1, 2], use_graphs=False, prefill_max_tokens=128
    )
    assert graphs.prefill_buckets == [16, 32, 64]  # 64 holds a 40-token chunk
    with caplog.at_level("WARNING"):
        none = CudaGraphRunner(
            runner, CaptureHiddenMode.NULL, 1, [2, 4], use_graphs=False, prefill_max_tokens=128
        )
    assert none.prefill_buckets == [] and "do not include 1" in caplog.text
