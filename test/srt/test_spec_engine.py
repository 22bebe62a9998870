"""Speculative decoding (EAGLE-3 chains, per-request draft lengths) against the plain engine.

Greedy outputs must be identical with and without speculation, whatever the draft proposes,
whatever each request's draft length is in each step, and whatever KV pressure, aborts and
prefix-cache hits happen; KV of rejected drafts must be freed at once.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.speculative.eagle_worker_v2 import drafts_by_request
from sglang.test.engine_checks import assert_no_kv_leak
from sglang.test.scheduler_utils import (
    abort,
    count_calls,
    make_scheduler,
    record_draft_proposals,
    record_step_proposals,
    run_until_idle,
    submit,
)

K = 3
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    sched = make_scheduler(tiny_model_dir, dtype="float32")
    outs: dict = {}
    for i, p in enumerate(prompts(24)):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    return {rid: o["output_ids"] for rid, o in outs.items()}


def spec_scheduler(tiny_model_dir, draft_dir, **kw):
    return make_scheduler(
        tiny_model_dir,
        dtype="float32",  # greedy equality is exact only without bf16 shape-dependent rounding
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=K,
        **kw,
    )


def oracle_drafts(sched, reference):
    """Replace the draft model with one that proposes the reference continuation (so every
    draft is accepted under greedy): exercises multi-token commits, stops inside accepted
    runs and catch-up over several pending positions."""
    worker = sched.tp_worker
    by_slot = {}

    def draft_tokens(mwb):
        reqs = {r.req_pool_idx: r for r in sched.running}
        drafts, qs = [], []
        for idx, d in zip(mwb.req_pool_indices, mwb.spec.draft_lens, strict=True):
            req = reqs[idx]
            ref = by_slot.get(req.rid) or reference[req.rid]
            L = len(req.output_ids)
            ds = (ref[L : L + d] + [0] * d)[:d]
            drafts.append(ds)
            for t in ds:
                hot = torch.nn.functional.one_hot(torch.tensor(t), worker.vocab_size).float()
                qs.append(hot.to(worker.device))
        flat = torch.tensor([t for ds in drafts for t in ds], dtype=torch.int64)
        return flat.to(worker.device), torch.stack(qs)

    worker.draft_tokens = draft_tokens
    return by_slot


def test_greedy_identical_random_draft_engine(tiny_model_dir, draft_dir, reference):
    ps = prompts(24)
    with Engine(
        model_path=tiny_model_dir,
        dtype="float32",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=K,
    ) as e:
        outs = e.generate(input_ids=ps, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [reference[f"r{i}"] for i in range(24)]
        meta = outs[0]["meta_info"]
        assert meta["spec_verify_ct"] == GREEDY["max_new_tokens"] - 1 - sum(
            k * n for k, n in enumerate(meta["spec_accept_histogram"])
        )
        assert meta["spec_num_proposed_drafts"] > 0
        info = assert_no_kv_leak(e)
        assert info["avg_spec_accept_length"] >= 1.0


def test_oracle_drafts_accept_everything(tiny_model_dir, draft_dir, reference):
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    oracle_drafts(sched, reference)
    outs: dict = {}
    for i, p in enumerate(prompts(24)[:8]):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    for i in range(8):
        o = outs[f"r{i}"]
        assert o["output_ids"] == reference[f"r{i}"]
        # 23 tokens after the prefill token, K + 1 per verify step: 6 steps.
        assert o["meta"]["spec_verify_ct"] == 6
        assert o["meta"]["spec_num_correct_drafts"] == o["meta"]["spec_num_proposed_drafts"]
    sched.kv.check_accounting()


@pytest.mark.parametrize("max_new", [1, 2, 3, 5])
def test_max_new_tokens_exact(tiny_model_dir, draft_dir, reference, max_new):
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    oracle_drafts(sched, reference)
    outs: dict = {}
    submit(sched, "r0", prompts(24)[0], {**GREEDY, "max_new_tokens": max_new})
    run_until_idle(sched, outs)
    assert outs["r0"]["output_ids"] == reference["r0"][:max_new]
    assert outs["r0"]["finish"]["type"] == "length"
    sched.kv.check_accounting()


def test_stop_token_inside_accepted_run(tiny_model_dir, draft_dir, reference):
    ref = reference["r1"]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    oracle_drafts(sched, reference)
    outs: dict = {}
    # The run that contains the stop token also crosses max_new_tokens.
    submit(
        sched, "r1", prompts(24)[1], {**GREEDY, "stop_token_ids": [ref[k]], "max_new_tokens": k + 2}
    )
    run_until_idle(sched, outs)
    o = outs["r1"]
    assert o["output_ids"] == ref[: k + 1]
    assert o["finish"] == {"type": "stop", "matched": ref[k]}
    assert o["meta"]["completion_tokens"] == k + 1
    sched.kv.check_accounting()


def test_stop_string_early_in_run(tiny_model_dir, draft_dir, reference):
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    oracle_drafts(sched, reference)
    ref = reference["r2"]
    text = sched.tokenizer.decode(ref)
    piece = sched.tokenizer.decode(ref[2:3])
    if not piece.strip():
        pytest.skip("token 2 decodes to whitespace")
    stop = piece.strip()[:2]
    outs: dict = {}
    submit(sched, "r2", prompts(24)[2], {**GREEDY, "stop": [stop]})
    run_until_idle(sched, outs)
    o = outs["r2"]
    assert o["finish"]["type"] == "stop" and o["finish"]["matched"] == stop
    assert o["text"] == text[: text.index(stop)]
    assert ref[: len(o["output_ids"])] == o["output_ids"] and len(o["output_ids"]) <= 3
    sched.kv.check_accounting()


def test_mixed_caps_and_temperatures_in_one_batch(tiny_model_dir, draft_dir, reference):
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    oracle_drafts(sched, reference)
    outs: dict = {}
    ps = prompts(24)
    for i in range(12):
        params = {**GREEDY, "max_draft_tokens": [0, 1, K][i % 3]}
        if i % 2:
            params.update(temperature=0.8, sampling_seed=i)
        submit(sched, f"r{i}", ps[i], params)
    run_until_idle(sched, outs)
    for i in range(0, 12, 2):
        assert outs[f"r{i}"]["output_ids"] == reference[f"r{i}"]
        if i % 3 == 0:
            assert outs[f"r{i}"]["meta"]["spec_num_proposed_drafts"] == 0
    for i in range(1, 12, 2):
        assert len(outs[f"r{i}"]["output_ids"]) == GREEDY["max_new_tokens"]
    sched.kv.check_accounting()


PROCESSOR_PARAMS = [
    # Tokens 300 / 301 biased far above the tiny model's own choices, so the penalties decide
    # which of them comes next: they alternate, and only when every earlier token (drafts
    # included) is counted.
    {"logit_bias": {"300": 100, "301": 99}, "frequency_penalty": 2.0},
    {"logit_bias": {"300": 100, "301": 99.5}, "presence_penalty": 1.0, "repetition_penalty": 2.0},
    {"min_new_tokens": 8, "logit_bias": {"300": 2.0}},  # processors that read no ids
    {},  # plain greedy rows in the same batches
]


@pytest.mark.parametrize("drafts", ["random", "oracle"])
def test_greedy_with_logits_processors_identical(tiny_model_dir, draft_dir, reference, drafts):
    """Greedy requests with penalties, logit_bias and min_new_tokens in one batch: output
    equals the plain engine's, whether the drafts are mostly rejected (random draft) or all
    accepted (oracle: verify rows must count the earlier drafts as generated, or the
    penalised target diverges)."""
    ps = prompts(8)
    params = [{**GREEDY, **PROCESSOR_PARAMS[i % 4]} for i in range(8)]
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    ref: dict = {}
    for i in range(8):
        submit(plain, f"r{i}", ps[i], params[i])
    run_until_idle(plain, ref)
    expected = {rid: o["output_ids"] for rid, o in ref.items()}
    # the penalties change the outputs (else this test could not see them ignored)
    assert all(expected[f"r{i}"] != reference[f"r{i}"] for i in (0, 1, 4, 5))
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    if drafts == "oracle":
        oracle_drafts(sched, expected)
    outs: dict = {}
    for i in range(8):
        submit(sched, f"r{i}", ps[i], params[i])
    run_until_idle(sched, outs)
    assert {rid: o["output_ids"] for rid, o in outs.items()} == expected
    accepted = sum(o["meta"]["spec_num_correct_drafts"] for o in outs.values())
    if drafts == "oracle":
        assert accepted == sum(o["meta"]["spec_num_proposed_drafts"] for o in outs.values()) > 0
    sched.kv.check_accounting()


def test_toggled_draft_length_keeps_draft_state(tiny_model_dir, draft_dir, reference):
    """A request whose d alternates between 0 and K produces identical output, and after each
    resume its draft proposes exactly what a never-toggled request proposes at that position
    (so the catch-up draft extend restored the draft KV)."""
    ps = prompts(24)

    def run(toggle: bool) -> tuple[list[int], dict[int, list[int]]]:
        sched = spec_scheduler(tiny_model_dir, draft_dir)
        proposals = record_draft_proposals(sched.tp_worker)
        step = {"n": 0}
        base = sched.spec.choose_draft_lens

        def toggled(reqs):
            step["n"] += 1
            lens = base(reqs)
            return [0 if toggle and (step["n"] // 3) % 2 else d for d in lens]

        sched.spec.choose_draft_lens = toggled
        outs: dict = {}
        submit(sched, "r3", ps[3], {**GREEDY, "max_new_tokens": 40})
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        return outs["r3"]["output_ids"], proposals

    plain_out, plain_props = run(False)
    tog_out, tog_props = run(True)
    assert tog_out == plain_out
    common = set(plain_props) & set(tog_props)
    assert len(common) >= 3
    assert all(plain_props[n] == tog_props[n] for n in common)


@pytest.mark.parametrize("overlap", [False, True])
def test_no_leak_after_aborts_and_retractions(tiny_model_dir, draft_dir, overlap):
    """With overlap scheduling (the CUDA default) a step that was in flight while its
    requests were aborted or retracted is committed for the surviving rows only."""
    sched = spec_scheduler(
        tiny_model_dir, draft_dir, max_total_tokens=300, disable_overlap_schedule=not overlap
    )
    rng = random.Random(1)
    outs: dict = {}
    ps = prompts(200, seed=3)
    for i, p in enumerate(ps):
        params = {
            "max_new_tokens": rng.randrange(1, 64),
            "ignore_eos": True,
            "temperature": rng.choice([0, 0.7]),
            "max_draft_tokens": rng.randrange(0, K + 1),
        }
        submit(sched, f"a{i}", p, params, seed=i)
        if i % 10 == 9:
            for _ in range(3):
                sched.step()
            abort(sched, f"a{i - rng.randrange(0, 9)}")
    run_until_idle(sched, outs)
    assert len(outs) == 200 and all(o["finish"] is not None for o in outs.values())
    assert sched.stats["num_retractions"] > 0
    assert any(o["finish"]["type"] == "abort" for o in outs.values())
    sched.kv.check_accounting()


def test_radix_hits_under_speculation(tiny_model_dir, draft_dir):
    shared = prompts(1, seed=9)[0] * 3
    ps = [shared + [500 + i] for i in range(6)]
    results = []
    for disable in (True, False):
        sched = spec_scheduler(tiny_model_dir, draft_dir, disable_radix_cache=disable)
        outs: dict = {}
        for i, p in enumerate(ps):  # one at a time so later ones hit the cache
            submit(sched, f"p{i}", p, GREEDY)
            run_until_idle(sched, outs)
        results.append([outs[f"p{i}"]["output_ids"] for i in range(6)])
        if not disable:
            assert sum(outs[f"p{i}"]["meta"]["cached_tokens"] for i in range(6)) > 0
        sched.kv.check_accounting()
    assert results[0] == results[1]


def test_logprobs_are_the_targets(tiny_model_dir, draft_dir, reference):
    ps = prompts(24)
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    spec = spec_scheduler(tiny_model_dir, draft_dir)
    oracle_drafts(spec, reference)
    a, b = {}, {}
    submit(plain, "r4", ps[4], GREEDY, return_logprob=True)
    submit(spec, "r4", ps[4], GREEDY, return_logprob=True)
    run_until_idle(plain, a)
    run_until_idle(spec, b)
    la, lb = a["r4"]["logprobs"], b["r4"]["logprobs"]
    assert len(la) == len(lb) == GREEDY["max_new_tokens"]
    for (x, tx), (y, ty) in zip(la, lb, strict=True):
        assert tx == ty and abs(x - y) < 1e-4


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"speculative_eagle_topk": 4}, "topk"),
        ({"speculative_num_steps": 3, "speculative_num_draft_tokens": 7}, "num-draft-tokens"),
        ({"speculative_algorithm": "MEDUSA"}, "speculative-algorithm"),
    ],
)
def test_bad_speculative_flags(tiny_model_dir, draft_dir, kw, msg):
    args = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft_dir, **kw}
    with pytest.raises(ValueError, match=msg):
        make_scheduler(tiny_model_dir, **args)


def test_trained_tiny_draft_is_often_right_and_lossless(tiny_model_dir, tmp_path_factory):
    """Issue 5's loop end to end: a short EAGLE-3 training run on the tiny target's own
    continuations gives a draft the engine loads, that is often right, and that keeps greedy
    output identical to no speculation."""
    from sglang.test.tiny_eagle3 import train_tiny_draft

    texts = [f"Request {i}: tell me about {w}" for i, w in enumerate("abcdefghijkl")]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    draft = train_tiny_draft(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("trained")),
        steps=300,
        prompts=texts,
        max_new_tokens=24,
    )
    with Engine(model_path=tiny_model_dir, dtype="float32") as e:
        ref = [o["output_ids"] for o in e.generate(texts, params)]
    with Engine(
        model_path=tiny_model_dir,
        dtype="float32",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=K,
    ) as e:
        outs = e.generate(texts, params)
        n2 = e.generate(texts[0], {**params, "n": 2})
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == ref
    assert [o["output_ids"] for o in n2] == [ref[0], ref[0]]
    correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
    proposed = sum(o["meta_info"]["spec_num_proposed_drafts"] for o in outs)
    accept_len = sum(len(r) for r in ref) / sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    assert correct / proposed > 0.5 and accept_len > 2.0, (correct, proposed, accept_len)


def test_all_greedy_drafts_equal_the_sampling_path(tiny_model_dir, draft_dir):
    """With every request greedy, _pick takes the draft's argmax directly; the general path
    (softmax, one-hot for greedy rows, seeded sampling) must propose the same tokens. Each
    drafting step is run through both paths (the second rewrites the same draft KV slots with
    the same values) and the proposals compared."""
    sched = spec_scheduler(tiny_model_dir, draft_dir)
    worker = sched.tp_worker
    real = worker.draft_tokens
    compared = []

    def both(mwb):
        fast, q_fast = real(mwb)
        info = mwb.sampling_info
        assert info.is_all_greedy and q_fast is None
        info.is_all_greedy = False  # the sampling path, greedy rows one-hot
        try:
            general, q = real(mwb)
        finally:
            info.is_all_greedy = True
        assert general.tolist() == fast.tolist()
        assert q is not None and q.shape[0] == fast.numel() == sum(mwb.spec.draft_lens)
        compared.append(fast.numel())
        return fast, q_fast

    worker.draft_tokens = both
    outs: dict = {}
    for i, p in enumerate(prompts(24)[:4]):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    assert len(compared) >= 5 and sum(compared) >= 5 * K
    sched.kv.check_accounting()


def test_mixed_draft_lengths_sampled_batch_with_penalties(tiny_model_dir, draft_dir):
    """Draft lengths d = [2, 0, 3, 1] (rotating) in batches of greedy and sampled requests
    with penalties: every draft sits in its request's verify rows with its own q row (a
    greedy request's q row is one-hot at its draft), the greedy requests (verified by the
    sampling path, penalties counting the drafts) equal the plain engine, and the sampled
    ones are reproducible."""
    ps = prompts(8, seed=5)
    # greedy: penalties that change the output (PROCESSOR_PARAMS); sampled: penalties only
    pen = [{"frequency_penalty": 1.5}, {"repetition_penalty": 1.8, "presence_penalty": 0.5}]
    params = [
        {**GREEDY, **pen[(i // 2) % 2], "temperature": 0.8, "sampling_seed": i}
        if i % 2
        else {**GREEDY, **PROCESSOR_PARAMS[(i // 2) % 2]}
        for i in range(8)
    ]
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    ref: dict = {}
    for i in range(8):
        submit(plain, f"r{i}", ps[i], params[i])
    run_until_idle(plain, ref)

    def run() -> tuple[dict, list[list[int]]]:
        sched = spec_scheduler(tiny_model_dir, draft_dir)
        worker, seen = sched.tp_worker, []
        real, base = worker.draft_tokens, sched.spec.choose_draft_lens

        def mixed(reqs):
            caps, k = base(reqs), len(seen)
            return [min(c, [2, 0, 3, 1][(j + k) % 4]) for j, c in enumerate(caps)]

        def checked(mwb):
            drafts, q = real(mwb)
            d = mwb.spec.draft_lens
            assert drafts.shape == (sum(d),) and q.shape[0] == sum(d)
            greedy = mwb.sampling_info.greedy_mask.tolist()
            k = 0
            for i, ds in enumerate(drafts_by_request(drafts, d)):
                for x in ds:
                    assert q[k, x] > 0  # x was drawn from q's row
                    if greedy[i]:
                        assert q[k, x] == 1.0 and q[k].sum() == 1.0
                    k += 1
            seen.append(list(d))
            return drafts, q

        worker.draft_tokens, sched.spec.choose_draft_lens = checked, mixed
        outs: dict = {}
        for i in range(8):
            submit(sched, f"r{i}", ps[i], params[i])
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        return {rid: o["output_ids"] for rid, o in outs.items()}, seen

    first, seen = run()
    assert any(0 in d and len(set(d) - {0}) >= 2 for d in seen)  # ragged steps happened
    for i in range(0, 8, 2):
        assert first[f"r{i}"] == ref[f"r{i}"]["output_ids"]
    assert run()[0] == first


def test_padded_draft_graph_runners_equal_eager_engine(
    tiny_model_dir, draft_dir, reference, monkeypatch
):
    """The draft's extend and decode graph runners run eagerly over their padded static
    batches (the CUDA-graph path's padding on CPU) inside the engine: three requests in the
    bs-4 bucket, ragged catch-ups, and catch-ups longer than K + 1 (after steps without
    drafting) falling back to the unpadded forward. Outputs equal the plain engine's and
    every proposal equals the eager run's. (On a GPU the worker's whole-chain graphs, which
    would take these greedy steps, are off.)"""
    monkeypatch.setenv("SGLANG_DRAFT_CHAIN_GRAPHS", "0")
    ps = prompts(24)

    def run(padded: bool):
        sched = spec_scheduler(tiny_model_dir, draft_dir)
        worker, calls = sched.tp_worker, {"graph": 0, "long": 0}
        draft = worker.draft
        if padded:
            draft.init_cuda_graphs([1, 2, 4], K + 1, use_graphs=False)
            count_calls(draft.extend_graph_runner, "extend", calls, "graph")
        real_catch_up = draft.catch_up

        def catch_up(*args):
            calls["long"] += max(args[4]) > K + 1  # extend_lens
            return real_catch_up(*args)

        draft.catch_up = catch_up
        proposals = record_step_proposals(worker)
        step, base = {"n": 0}, sched.spec.choose_draft_lens

        def toggled(reqs):  # catch-ups of 1 to 3 tokens, and of 6 (r2 skips steps 10..14)
            step["n"] += 1
            n, lens = step["n"], base(reqs)
            on = ["111111", "101101", "100111"]
            return [
                d
                if on[int(r.rid[1:])][n % 6] == "1" and not (r.rid == "r2" and 10 <= n < 15)
                else 0
                for r, d in zip(reqs, lens, strict=True)
            ]

        sched.spec.choose_draft_lens = toggled
        outs: dict = {}
        for i in range(3):
            submit(sched, f"r{i}", ps[i], GREEDY)
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        return {rid: o["output_ids"] for rid, o in outs.items()}, proposals, calls

    eager, eager_props, _ = run(False)
    padded, padded_props, calls = run(True)
    assert eager == padded == {f"r{i}": reference[f"r{i}"] for i in range(3)}
    assert padded_props == eager_props and len(padded_props) >= 5
    # every drafting step but those with a long catch-up went through the padded runner
    assert calls["long"] >= 1 and calls["graph"] == len(padded_props) - calls["long"] >= 10


def chain_vs_step_by_step(tiny_model_dir, draft_dir, device: str, monkeypatch):
    """Three requests (bs-4 bucket) with per-request draft lengths of 0 to K changing every
    step, run with the step-by-step chain and with DraftChainGraphRunner (on CPU set up
    eagerly; on CUDA the worker's own graphs, switched off by SGLANG_DRAFT_CHAIN_GRAPHS=0).
    Returns per run (outputs, per-step proposals, chain calls, draft K/V: the pool without
    the padding slot 0, then each drafting step's verify-row slots right after drafting)."""
    ps = prompts(24)

    def run(chain: bool):
        monkeypatch.setenv("SGLANG_DRAFT_CHAIN_GRAPHS", "1" if chain else "0")
        kw = dict(device="cuda", attention_backend="triton", disable_overlap_schedule=True)
        sched = spec_scheduler(tiny_model_dir, draft_dir, **(kw if device == "cuda" else {}))
        worker, calls = sched.tp_worker, {"chain": 0}
        draft = worker.draft
        if chain and device == "cpu":
            assert draft.init_chain_graphs(worker.hidden_pool, [1, 2, 4], K, use_graphs=False)
        assert (draft.chain_graph_runner is not None) == chain
        if chain:
            count_calls(draft.chain_graph_runner, "draft", calls, "chain")
        proposals = record_step_proposals(worker)
        # the draft K/V in the verify rows' slots right after each drafting step (the draft
        # steps' entries: a later catch-up or reuse of the slot overwrites them)
        step_kv, real_tokens = [], worker.draft_tokens

        def snapshot(mwb):
            out = real_tokens(mwb)
            loc = mwb.out_cache_loc.to(draft.kv_pool.k_buffer[0].device)
            step_kv.append(
                torch.cat([draft.kv_pool.k_buffer[0][loc], draft.kv_pool.v_buffer[0][loc]]).cpu()
            )
            return out

        worker.draft_tokens = snapshot
        step = {"n": 0}

        def varied(reqs):  # d_i in 0..K per step and request; r2 skips steps 10..14
            step["n"] += 1
            n = step["n"]
            pattern = ["313213", "120302", "302031"]
            return [
                0 if r.rid == "r2" and 10 <= n < 15 else int(pattern[int(r.rid[1:])][n % 6])
                for r in reqs
            ]

        sched.spec.choose_draft_lens = varied
        outs: dict = {}
        for i in range(3):
            submit(sched, f"r{i}", ps[i], GREEDY)
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        pool = draft.kv_pool  # slot 0 (padding) excluded: frozen rows write there
        kv = (pool.k_buffer[0][1:].cpu(), pool.v_buffer[0][1:].cpu(), *step_kv)
        return {rid: o["output_ids"] for rid, o in outs.items()}, proposals, calls, kv

    return run(False), run(True)


def check_chain_equals_step_by_step(step, chained) -> None:
    (step_out, step_props, _, step_kv), (chain_out, chain_props, calls, chain_kv) = step, chained
    assert chain_out == step_out
    assert chain_props == step_props and len(chain_props) >= 8
    assert any(len({len(p) for p in props}) >= 3 for props in chain_props)  # ragged d_i
    # every drafting step but the one after r2's long stretch without drafting was chained
    assert len(chain_props) - 2 <= calls["chain"] < len(chain_props)
    # the final pools, then each drafting step's verify-row slots: positions (RoPE), KV
    # lengths, slots and inputs of every draft step
    for got, want in zip(chain_kv, step_kv, strict=True):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_chain_draft_graph_runner_equals_step_by_step_engine(
    tiny_model_dir, draft_dir, reference, monkeypatch
):
    """Whole greedy drafting steps through DraftChainGraphRunner (run eagerly over its padded
    static batch: three requests in the bs-4 bucket, its Triton attention through the
    interpreter) inside the engine propose exactly what the step-by-step chain proposes, with
    per-request draft lengths of 0 to K changing every step (rows that stop early stay
    frozen), catch-ups of 1 to K + 1 tokens, and a catch-up longer than K + 1 falling back to
    the step-by-step path; the draft KV pool ends up the same in every slot but the padding
    slot (positions, slots and inputs of every draft step). Outputs equal the plain
    engine's."""
    step, chained = chain_vs_step_by_step(tiny_model_dir, draft_dir, "cpu", monkeypatch)
    check_chain_equals_step_by_step(step, chained)
    assert step[0] == {f"r{i}": reference[f"r{i}"] for i in range(3)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_draft_cuda_graph_equals_step_by_step_engine(tiny_model_dir, draft_dir, monkeypatch):
    """The same on CUDA (float32, Triton attention for target and draft): the worker's
    captured chain graphs against its step-by-step draft graphs."""
    step, chained = chain_vs_step_by_step(tiny_model_dir, draft_dir, "cuda", monkeypatch)
    check_chain_equals_step_by_step(step, chained)
