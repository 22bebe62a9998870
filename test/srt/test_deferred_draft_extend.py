"""While speculation is off (the adaptive policy chooses no drafts at all), the scheduler runs
like a server without speculation: prefills defer the draft extend (their aux hidden states
stay pending for the catch-up of a later drafting step), and cached prefixes whose draft KV is
not valid serve the target. Outputs stay those of the plain engine, the draft state after a
deferred prefill is the one an eager draft extend gives, and no KV leaks.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import sglang.srt.managers.scheduler_output_processor as sop
from sglang.srt.speculative.adaptive import AdaptiveController, parse_adaptive_config
from sglang.srt.speculative.spec_info import SpecPlan
from sglang.test.adaptive_sim import LIGHT, pending_req, synthetic
from sglang.test.scheduler_utils import (
    collect,
    make_scheduler,
    record_draft_proposals,
    run_until_idle,
    submit,
)

K = 3
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def spec_scheduler(tiny_model_dir, draft_dir, **kw):
    return make_scheduler(
        tiny_model_dir,
        dtype="float32",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=K,
        **kw,
    )


def switch_speculation(sched, off: dict) -> list[list[bool]]:
    """Drive the scheduler's speculative half by hand: while off["value"], no request drafts
    and speculation counts as off (takes_target_only_prefix); else every request drafts its
    cap. Returns the draft_keep_rows of every prefill plan."""
    spec = sched.spec
    base_choose, base_plan = spec.choose_draft_lens, spec.build_plan
    keeps: list[list[bool]] = []
    spec.takes_target_only_prefix = lambda: off["value"]
    spec.choose_draft_lens = lambda reqs: [0] * len(reqs) if off["value"] else base_choose(reqs)

    def plan(batch) -> SpecPlan:
        p = base_plan(batch)
        if p.draft_keep_rows:
            keeps.append(list(p.draft_keep_rows))
        return p

    spec.build_plan = plan
    return keeps


def adaptive_off(tiny_model_dir, draft_dir) -> tuple:
    """(scheduler, controller, outputs, conversation so far): an adaptive scheduler without
    the guard (the synthetic step-time models decide here; the guard would rightly block the
    drafting they ask for once it measures that drafting is slower on this CPU) whose policy
    chose no drafts for a first 30-token turn t0 (a model under which drafting never pays).
    Its all-zero reuse window stops growing at 32 steps: the tests swap the step-time model
    between turns, which the policy sees at its next run, and a later turn must see it within
    its few decode steps (at the default recheck_max of 128 it may run without a policy run)."""
    sched = spec_scheduler(
        tiny_model_dir,
        draft_dir,
        speculative_adaptive=True,
        speculative_adaptive_config=json.dumps({"guard": False, "recheck_max": 32}),
    )
    ctl = sched.spec.adaptive
    ctl.time_model = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)  # never pays
    outs: dict = {}
    p = prompt(30, seed=4)
    submit(sched, "t0", p, GREEDY)
    run_until_idle(sched, outs)
    return sched, ctl, outs, p


def next_turns(sched, outs: dict, p: list[int], turns, n: int, seed: int) -> list[int]:
    """Run turns t<k> for k in `turns`, each the conversation so far (p, then each previous
    turn's answer) plus n new tokens (prompt seed seed + k). Returns the conversation."""
    for k in turns:
        p = p + outs[f"t{k - 1}"]["output_ids"] + prompt(n, seed=seed + k)
        submit(sched, f"t{k}", p, GREEDY)
        run_until_idle(sched, outs)
    return p


@pytest.mark.parametrize("chunked,overlap", [(False, False), (True, False), (True, True)])
def test_deferred_draft_extend_restores_the_draft_state(
    tiny_model_dir, draft_dir, chunked, overlap
):
    """A request prefilled while speculation is off, then decoded for a while without drafts,
    catches its draft up when it drafts: the draft KV of its prompt equals what an eager draft
    extend at prefill writes (the catch-up consumed the deferred prompt rows, in order), it
    drafts the same tokens at the same positions, and its output is the plain engine's."""
    p = prompt(40, seed=1)
    kw = {"chunked_prefill_size": 16} if chunked else {}
    kw["disable_overlap_schedule"] = not overlap  # overlap: commits come a step late

    def run(defer: bool) -> tuple[list[int], dict[int, list[int]], list[list[bool]], object]:
        sched = spec_scheduler(tiny_model_dir, draft_dir, **kw)
        off = {"value": defer}
        keeps = switch_speculation(sched, off)
        worker = sched.tp_worker
        proposals = record_draft_proposals(worker)
        outs: dict = {}
        submit(sched, "r", p, {**GREEDY, "max_new_tokens": 40})
        for _ in range(8):  # the prefill (chunks) and a few plain steps
            sched.step()
        off["value"] = False
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        stats = sched.spec.stats
        assert stats["spec_deferred_draft_extends"] == sum(map(sum, keeps))
        # every chunk either deferred or ran its draft extend (the request never went stale)
        assert stats["spec_stale_prefills"] == 0
        assert stats["spec_prefill_draft_extends"] == sum(len(k) - sum(k) for k in keeps)
        out = outs["r"]["output_ids"]
        # the finished request's draft-valid KV is cached: read the draft KV of its prompt
        m = sched.tree_cache.match_prefix(p + out[:-1], draft_only=True)
        assert m.draft_valid_len > len(p)
        slots = m.device_indices[: len(p)]
        pool = worker.draft.kv_pool
        return out, proposals, keeps, (pool.k_buffer[0][slots], pool.v_buffer[0][slots])

    plain = make_scheduler(tiny_model_dir, dtype="float32", **kw)
    ref: dict = {}
    submit(plain, "r", p, {**GREEDY, "max_new_tokens": 40})
    run_until_idle(plain, ref)

    eager_out, eager_props, eager_keeps, eager_kv = run(False)
    lazy_out, lazy_props, lazy_keeps, lazy_kv = run(True)
    assert eager_out == lazy_out == ref["r"]["output_ids"]
    assert not any(k for ks in eager_keeps for k in ks)
    assert lazy_keeps and all(k for ks in lazy_keeps for k in ks)  # every chunk deferred
    assert len(lazy_keeps) == (3 if chunked else 1)
    for a, b in zip(eager_kv, lazy_kv, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
    common = set(eager_props) & set(lazy_props)
    assert len(common) >= 3
    assert all(eager_props[n] == lazy_props[n] for n in common)


def test_target_only_prefix_hits_while_speculation_is_off(tiny_model_dir, draft_dir):
    """Tokens decoded without drafting are cached for the target (the draft lags there): a
    follow-up turn hits them while speculation is off, as on a plain server but for the
    prefix's last position, which it computes in a slot of its own (its draft's entry there
    depends on its own next token; as it stays off, it does not draft); with speculation on,
    the match stops where the draft KV does. Outputs equal the plain engine's in both cases
    and the KV accounting balances."""
    first = prompt(30, seed=2)

    def turns(sched) -> tuple[list[list[int]], list[int]]:
        outs: dict = {}
        submit(sched, "t1", first, GREEDY)
        run_until_idle(sched, outs)
        follow = first + outs["t1"]["output_ids"] + prompt(5, seed=3)
        submit(sched, "t2", follow, GREEDY)
        run_until_idle(sched, outs)
        cached = [outs[r]["meta"]["cached_tokens"] for r in ("t1", "t2")]
        return [outs[r]["output_ids"] for r in ("t1", "t2")], cached

    ref, ref_cached = turns(make_scheduler(tiny_model_dir, dtype="float32"))
    assert ref_cached[1] == 30 + 23  # the first turn and its answer (but the last token)

    sched = spec_scheduler(tiny_model_dir, draft_dir)
    off = {"value": True}
    switch_speculation(sched, off)
    out, cached = turns(sched)
    assert out == ref and cached == [ref_cached[0], ref_cached[1] - 1]
    assert sched.spec.stats["spec_drafting_steps"] == 0
    sched.kv.check_accounting()

    sched = spec_scheduler(tiny_model_dir, draft_dir)
    off = {"value": True}
    switch_speculation(sched, off)
    outs: dict = {}
    submit(sched, "t1", first, GREEDY)
    run_until_idle(sched, outs)
    off["value"] = False  # speculation back on: the draft-valid prefix only, then drafting
    follow = first + outs["t1"]["output_ids"] + prompt(5, seed=3)
    submit(sched, "t2", follow, GREEDY)
    run_until_idle(sched, outs)
    assert outs["t2"]["output_ids"] == ref[1]
    assert outs["t2"]["meta"]["cached_tokens"] < ref_cached[1]
    assert sched.spec.stats["spec_drafting_steps"] > 0
    sched.kv.check_accounting()


@pytest.mark.parametrize("overlap", [False, True])
def test_target_only_prefix_catches_up_to_the_draft_state_of_a_drafted_one(
    tiny_model_dir, draft_dir, overlap
):
    """A follow-up turn admitted while speculation is off takes the previous turn (decoded
    without drafting, so target-only in the cache) as its prefix; speculation then comes back
    on while it runs. Its first drafting step catches the draft up over the whole prefix from
    the hidden state pool: it proposes the same drafts at the same positions as the same turn
    in a run that drafted all along (whose prefix had valid draft KV), the draft KV of the
    conversation ends up the same, and the outputs are the plain engine's."""
    first = prompt(30, seed=11)
    kw = overlap_kw(overlap)

    def run(lazy: bool) -> tuple[list[int], dict[int, list[int]], torch.Tensor]:
        sched = spec_scheduler(tiny_model_dir, draft_dir, **kw)
        off = {"value": lazy}
        switch_speculation(sched, off)
        outs: dict = {}
        submit(sched, "t1", first, GREEDY)
        run_until_idle(sched, outs)
        follow = first + outs["t1"]["output_ids"] + prompt(6, seed=12)
        proposals = record_draft_proposals(sched.tp_worker)
        submit(sched, "t2", follow, GREEDY)
        for _ in range(4):  # its prefill and a few plain steps while (lazy) still off
            sched.step()
        if lazy:
            assert outs.get("t2") is None and sched.spec.stats["spec_drafting_steps"] == 0
            t2 = sched.running[0]
            assert t2.draft.draft_kv_len == 0 and not t2.draft.stale  # all of it pending
        off["value"] = False
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        tokens = follow + outs["t2"]["output_ids"][:-1]
        m = sched.tree_cache.match_prefix(tokens, draft_only=True)
        assert m.draft_valid_len > len(follow)
        slots = m.device_indices[: len(follow)]
        draft_k = sched.tp_worker.draft.kv_pool.k_buffer[0][slots]
        return outs["t2"]["output_ids"], proposals, draft_k

    plain = make_scheduler(tiny_model_dir, dtype="float32", **kw)
    ref: dict = {}
    submit(plain, "t1", first, GREEDY)
    run_until_idle(plain, ref)
    submit(plain, "t2", first + ref["t1"]["output_ids"] + prompt(6, seed=12), GREEDY)
    run_until_idle(plain, ref)

    eager_out, eager_props, eager_k = run(lazy=False)
    lazy_out, lazy_props, lazy_k = run(lazy=True)
    assert eager_out == lazy_out == ref["t2"]["output_ids"]
    common = set(eager_props) & set(lazy_props)
    assert len(common) >= 3
    assert all(eager_props[n] == lazy_props[n] for n in common)
    assert torch.allclose(eager_k, lazy_k, rtol=1e-4, atol=1e-5), (eager_k - lazy_k).abs().max()


def test_drafting_off_follows_the_goodput_policy_only():
    """drafting_off: after the goodput policy chose no drafts at all, until it drafts again;
    never with defer_draft_extend false, never for the tier baseline."""

    reqs = [pending_req(i) for i in range(4)]
    nothing_pays = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)

    ctl = AdaptiveController(parse_adaptive_config(None), K, num_slots=8)
    assert not ctl.drafting_off()  # nothing decided yet: prefills extend the draft
    ctl.time_model = nothing_pays
    assert ctl.choose(reqs, [K] * 4) == [0] * 4 and ctl.drafting_off()
    ctl.time_model = LIGHT
    assert max(ctl.choose(reqs, [K] * 4)) > 0 and not ctl.drafting_off()

    cfg = parse_adaptive_config(json.dumps({"defer_draft_extend": False}))
    ctl = AdaptiveController(cfg, K, num_slots=8)
    ctl.time_model = nothing_pays
    assert ctl.choose(reqs, [K] * 4) == [0] * 4 and not ctl.drafting_off()

    tiers = parse_adaptive_config(json.dumps({"policy": "tiers", "tiers": {"1": 0}}))
    ctl = AdaptiveController(tiers, K, num_slots=8)
    assert ctl.choose(reqs, [K] * 4) == [0] * 4 and not ctl.drafting_off()


def test_speculation_turns_back_on_when_only_target_only_requests_run(tiny_model_dir, draft_dir):
    """A conversation whose next turn takes the previous answer as a target-only prefix
    (admitted while speculation is off) has a request whose draft lags by that prefix. Once
    the goodput policy finds that drafting pays, speculation is back on: that request catches
    its draft up over the prefix (the hidden states are the pool rows of the cached slots)
    and drafts, and so does the next turn. Outputs stay the plain engine's. (Before the
    hidden state pool such a request could never draft, and before the policy ran on
    requests that cannot draft, speculation stayed off for good.)"""
    sched, ctl, outs, p = adaptive_off(tiny_model_dir, draft_dir)
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    ref: dict = {}
    submit(plain, "t0", p, GREEDY)
    run_until_idle(plain, ref)
    assert ctl.drafting_off()
    ctl.time_model = LIGHT  # drafting pays from now on
    next_turns(sched, outs, p, (1, 2), n=5, seed=5)
    next_turns(plain, ref, p, (1, 2), n=5, seed=5)
    # t1 took the target-only prefix but its last position (admitted while off), then caught
    # up and drafted
    assert outs["t1"]["meta"]["cached_tokens"] == ref["t1"]["meta"]["cached_tokens"] - 1
    assert outs["t1"]["meta"]["spec_num_proposed_drafts"] > 0
    assert outs["t2"]["meta"]["spec_num_proposed_drafts"] > 0
    assert all(outs[t]["output_ids"] == ref[t]["output_ids"] for t in ("t0", "t1", "t2"))
    sched.kv.check_accounting()


def test_long_target_only_contexts_do_not_count_as_catch_up(tiny_model_dir, draft_dir):
    """As above with long turns (three of ~430 tokens taken as target-only prefixes while
    speculation is off) and a step-time model under which drafting pays only when there is
    little to catch up. The requests that can never draft have nothing to catch up: the
    policy must see 0 pending positions for them, not their whole lag, else drafting never
    looks worth it and speculation stays off for good (the hidden state pool's first version
    counted kv_len - draft_kv_len for them: 1302 positions here)."""
    sched, ctl, outs, p = adaptive_off(tiny_model_dir, draft_dir)
    p = next_turns(sched, outs, p, (1, 2, 3), n=400, seed=20)  # off: long target-only turns
    assert ctl.drafting_off()
    ctl.time_model = synthetic(
        const=4e-3, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4, spec_on=3e-4
    )  # pays at short catch-ups, not at a 1300-position one
    next_turns(sched, outs, p, (4, 5), n=5, seed=5)
    assert outs["t4"]["meta"]["spec_num_proposed_drafts"] == 0  # admitted while off
    assert outs["t5"]["meta"]["spec_num_proposed_drafts"] > 0  # speculation came back on
    sched.kv.check_accounting()


def test_moderate_target_only_contexts_let_speculation_come_back(tiny_model_dir, draft_dir):
    """As above with turns of ~300 tokens (contexts under MAX_PENDING_HIDDEN): once drafting
    pays again, a later turn drafts. A version where requests on target-only prefixes kept
    their lag pending (to catch up over it) failed this: each turn, admitted while off, lagged
    by its whole context, no single step could pay for that catch-up, and speculation stayed
    off for the rest of the conversation (found by a review helper, seventeenth session)."""
    sched, ctl, outs, p = adaptive_off(tiny_model_dir, draft_dir)
    p = next_turns(sched, outs, p, (1, 2), n=300, seed=20)
    assert ctl.drafting_off()
    ctl.time_model = synthetic(
        const=4e-3, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4, spec_on=3e-4
    )
    next_turns(sched, outs, p, (3, 4, 5, 6), n=5, seed=5)
    assert any(outs[f"t{k}"]["meta"]["spec_num_proposed_drafts"] > 0 for k in (4, 5, 6))
    sched.kv.check_accounting()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_hit_that_diverges_recomputes_the_last_draft_position(
    tiny_model_dir, draft_dir, overlap
):
    """The draft KV of a position is computed with the token after it. A request that shares
    a cached prefix and then diverges does not take the prefix's last position (its draft KV
    holds the other continuation's token): the request recomputes it, and its draft KV there
    equals a run without the cache."""
    shared = prompt(20, seed=6)
    a, b = shared + prompt(6, seed=7), shared + prompt(6, seed=8)

    def draft_kv_at(disable_radix: bool) -> tuple[object, int]:
        sched = spec_scheduler(
            tiny_model_dir,
            draft_dir,
            disable_radix_cache=disable_radix,
            disable_overlap_schedule=not overlap,
        )
        outs: dict = {}
        submit(sched, "a", a, GREEDY)
        run_until_idle(sched, outs)
        submit(sched, "b", b, {**GREEDY, "max_new_tokens": 8})
        # b's prefill: its draft extend writes positions up to len(b) - 2. With overlap
        # scheduling (the CUDA default) b joins `running` when the step commits, one later.
        for _ in range(3):
            sched.step()
            found = [r for r in sched.running if r.rid == "b"]
            if found:
                break
        (req,) = found
        slot = sched.req_to_token_pool.read(req.req_pool_idx, len(shared) - 1, len(shared))
        k = sched.tp_worker.draft.kv_pool.k_buffer[0][slot].clone()
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        return k, outs["b"]["meta"]["cached_tokens"]

    cached_k, cached = draft_kv_at(False)
    fresh_k, none = draft_kv_at(True)
    assert none == 0 and cached == len(shared) - 1
    assert torch.allclose(cached_k, fresh_k, rtol=1e-4, atol=1e-5)


def test_long_prompts_run_the_draft_extend_while_speculation_is_off(tiny_model_dir, draft_dir):
    """A prompt of more than MAX_PENDING_HIDDEN // 2 rows runs its draft extend even while
    speculation is off (deferred, it would leave too few plain decode steps before the request
    stops drafting for good); a short one defers."""
    from sglang.srt.managers.spec_scheduler import MAX_PENDING_HIDDEN

    sched = spec_scheduler(tiny_model_dir, draft_dir)
    keeps = switch_speculation(sched, {"value": True})
    outs: dict = {}
    submit(sched, "long", prompt(MAX_PENDING_HIDDEN // 2 + 1, seed=9), GREEDY)
    run_until_idle(sched, outs)
    submit(sched, "short", prompt(MAX_PENDING_HIDDEN // 2, seed=10), GREEDY)
    run_until_idle(sched, outs)
    assert keeps == [[False], [True]]
    sched.kv.check_accounting()


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_steps_keep_each_requests_own_rows(tiny_model_dir, draft_dir, overlap):
    """Three requests decode without drafts for a while; the first is aborted among them
    (with overlap, while the next step is in flight, so that step's commit sees a subset of
    its rows: the others' rows are not at their batch index). Then the other two draft: each
    catches up from the rows its plain steps kept, so every proposal equals the one of a run
    that drafted from the start, at the same position (the prompts' lengths keep the
    requests' positions apart), the draft KV of their prompts and outputs is the same, and
    the outputs are the plain engine's."""
    prompts = {"a": prompt(20, seed=3), "b": prompt(45, seed=4), "c": prompt(70, seed=5)}

    def run(sched, off: dict | None) -> tuple[dict, dict, dict]:
        """(outputs of b and c, draft proposals by position, draft K of b and c by rid)."""
        keeps = switch_speculation(sched, off) if off is not None else None
        proposals = record_draft_proposals(sched.tp_worker) if off is not None else {}
        outs: dict = {}
        for rid, p in prompts.items():
            submit(sched, rid, p, GREEDY)
        lazy = off is not None and off["value"]
        for step in range(10):  # prefills and plain steps (drafting ones in the eager run)
            if step == 6:
                sched.abort_request("a")
            sched.step()
        if lazy:
            assert keeps and all(all(k) for k in keeps)  # the prefills were deferred
            off["value"] = False
        run_until_idle(sched, outs)
        sched.kv.check_accounting()
        draft_k = {}
        if off is not None:  # the finished requests' draft KV, as the radix cache keeps it
            for rid in ("b", "c"):
                out = outs[rid]["output_ids"]
                m = sched.tree_cache.match_prefix(prompts[rid] + out[:-1], draft_only=True)
                pool = sched.tp_worker.draft.kv_pool
                slots = m.device_indices[: m.draft_valid_len]
                draft_k[rid] = pool.k_buffer[0][slots]
        return {rid: outs[rid]["output_ids"] for rid in ("b", "c")}, proposals, draft_k

    subsets: list[list[int]] = []
    real_subset = sop.subset_step

    def subset(batch, result, keep):
        subsets.append(list(keep))
        return real_subset(batch, result, keep)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sop, "subset_step", subset)
        ref, _, _ = run(
            make_scheduler(tiny_model_dir, dtype="float32", **overlap_kw(overlap)), None
        )
        eager, eager_props, eager_k = run(
            spec_scheduler(tiny_model_dir, draft_dir, **overlap_kw(overlap)), {"value": False}
        )
        subsets.clear()
        lazy, lazy_props, lazy_k = run(
            spec_scheduler(tiny_model_dir, draft_dir, **overlap_kw(overlap)), {"value": True}
        )
    assert eager == lazy == ref
    assert (subsets == [[1, 2]]) if overlap else not subsets  # "a" was row 0 of the step
    for rid in ("b", "c"):  # the draft KV of every position both runs hold
        a, b = eager_k[rid], lazy_k[rid]
        n = min(len(a), len(b))
        assert n > len(prompts[rid]) + 8
        assert torch.allclose(a[:n], b[:n], rtol=1e-4, atol=1e-5), (a[:n] - b[:n]).abs().max()
    common = set(eager_props) & set(lazy_props)
    assert any(45 <= n < 70 for n in common) and any(n >= 70 for n in common)  # "b" and "c"
    assert all(eager_props[n] == lazy_props[n] for n in common)


def overlap_kw(overlap: bool) -> dict:
    return {"disable_overlap_schedule": not overlap}


def test_catch_up_over_a_target_only_prefix_leaves_its_last_slot_alone(tiny_model_dir, draft_dir):
    """A turn admitted on the previous turn's target-only answer catches its draft up over
    it when speculation comes back on, but not into the slot of the prefix's last position:
    that entry depends on the token after it, which differs between requests sharing the
    prefix, so the turn computes that position in a slot of its own (a version without this
    overwrote the shared slot, found by a review helper in the seventeenth session)."""
    sched, ctl, outs, p = adaptive_off(tiny_model_dir, draft_dir)
    follow = p + outs["t0"]["output_ids"] + prompt(5, seed=6)
    m = sched.tree_cache.match_prefix(follow)
    # t0's prompt got its draft extend (speculation went off at its first decode step); its
    # answer was decoded without drafting
    assert m.draft_valid_len == 29 and len(m.device_indices) == 30 + 23
    last = m.device_indices[-1:]  # the prefix's last position: t0's slot
    k = sched.tp_worker.draft.kv_pool.k_buffer[0]
    before = k[last].clone()
    shared = m.device_indices[29:-1]  # target-only, caught up over in place
    assert not k[shared].abs().sum(-1).gt(0).any()  # no draft KV there yet
    ctl.time_model = LIGHT  # drafting pays from now on
    next_turns(sched, outs, p, (1,), n=5, seed=5)
    assert outs["t1"]["meta"]["spec_num_proposed_drafts"] > 0  # it caught up and drafted
    assert torch.equal(k[last], before)
    assert k[shared].abs().sum(-1).gt(0).all()  # the catch-up wrote the shared positions
    assert not k[last].abs().sum(-1).gt(0).any()  # never written: t0 did not draft there
    sched.kv.check_accounting()


@torch.no_grad()
def draft_entry_checks(sched) -> list[tuple]:
    """(request, slots [n] int64, ok [n] bool) for every running, non-stale request with n =
    draft_kv_len > 0: whether its draft KV entry at each position below n holds what that
    position must hold. EAGLE-3's V at position t is a function of the target hidden state at
    t (its pool row) and the request's token t + 1 alone, so it is recomputed here from those
    and compared (a review helper's oracle)."""
    w = sched.tp_worker
    model, pool = w.draft.model, w.draft.kv_pool
    attn = model.midlayer.self_attn
    out = []
    for r in sched.running:
        n = r.draft.draft_kv_len
        if r.req_pool_idx is None or r.draft.stale or n == 0:
            continue
        slots = sched.req_to_token_pool.read(r.req_pool_idx, 0, n).to(torch.int64)
        emb = model.embed_tokens(torch.tensor(r.fill_ids[1 : n + 1], dtype=torch.int64))
        h = model.project_hidden(w.hidden_pool.read(slots)).to(emb.dtype)
        x = torch.cat([model.midlayer.input_layernorm(emb), model.midlayer.hidden_norm(h)], -1)
        v = attn.qkv_proj(x)[0].split([attn.q_size, attn.kv_size, attn.kv_size], -1)[2]
        got = pool.v_buffer[0][slots].reshape(n, -1)
        out.append((r, slots, torch.isclose(v.reshape(n, -1), got, rtol=1e-3, atol=1e-4).all(-1)))
    return out


def wrong_draft_entries(sched) -> list[tuple[str, int]]:
    """(rid, position) of every running request's draft KV entry below its draft_kv_len that
    differs from what that position must hold (draft_entry_checks)."""
    return [
        (r.rid, i) for r, _, ok in draft_entry_checks(sched) for i in range(len(ok)) if not ok[i]
    ]


def off_after_first_turn(tiny_model_dir, draft_dir, **kw) -> tuple:
    """(scheduler, off switch, outputs, prompt): speculation switched off by hand
    (switch_speculation) and a first 30-token turn t0 run to the end, so that its answer is
    cached target-only."""
    sched = spec_scheduler(tiny_model_dir, draft_dir, **kw)
    off = {"value": True}
    switch_speculation(sched, off)
    outs: dict = {}
    p = prompt(30, seed=1)
    submit(sched, "t0", p, GREEDY)
    run_until_idle(sched, outs)
    return sched, off, outs, p


@pytest.mark.parametrize("together", [True, False])
def test_catch_up_never_crosses_a_branch_of_the_cache(tiny_model_dir, draft_dir, together):
    """Two conversations branch below a target-only prefix; their next turns are admitted
    while speculation is off, one or both running when it comes back on. The slot where the
    cache branches is shared by requests whose next token differs, so neither catches up over
    it (they never draft): no running request ever holds a draft entry that is wrong for its
    own tokens (a review helper's case; a version without the branch check wrote each one's
    entry over the other's). Outputs equal the plain engine's."""
    sched, off, outs, p = off_after_first_turn(tiny_model_dir, draft_dir)
    base = p + outs["t0"]["output_ids"]
    b1, b2 = base + prompt(5, seed=2), base + prompt(5, seed=3)
    submit(sched, "b1", b1, GREEDY)
    submit(sched, "b2", b2, GREEDY)
    run_until_idle(sched, outs)
    c = b1 + outs["b1"]["output_ids"] + prompt(4, seed=4)
    e = b2 + outs["b2"]["output_ids"] + prompt(4, seed=5)
    submit(sched, "c", c, GREEDY)
    if together:
        submit(sched, "e", e, GREEDY)
    for _ in range(3):
        sched.step()
    assert all(r.draft.stale for r in sched.running)  # both cross the branch after t0
    off["value"] = False
    sched.step()
    assert wrong_draft_entries(sched) == []
    if not together:
        submit(sched, "e", e, GREEDY)
        off["value"] = True
        sched.step()
        sched.step()
        off["value"] = False
        sched.step()
    assert wrong_draft_entries(sched) == []
    while not sched.is_idle():
        sched.step()
        collect(sched, outs)
        assert wrong_draft_entries(sched) == []
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    ref: dict = {}
    for rid, ids in (("t0", p), ("b1", b1), ("b2", b2), ("c", c), ("e", e)):
        submit(plain, rid, ids, GREEDY)
        run_until_idle(plain, ref)
    assert all(outs[r]["output_ids"] == ref[r]["output_ids"] for r in ref)
    sched.kv.check_accounting()


def test_target_only_prefix_stops_before_a_near_branch_and_drafts_later(tiny_model_dir, draft_dir):
    """A request admitted while speculation is off whose cached prefix crosses a branch of the
    cache at most MAX_BRANCH_CUT tokens before its end takes the prefix only up to the
    branch: it recomputes those tokens, stays able to draft, and drafts once speculation is
    back, with no wrong draft entry at any step and the plain engine's output. (Before, it
    never drafted: with a chat template that was most requests admitted under load.)"""
    from sglang.srt.managers.batch_builder import MAX_BRANCH_CUT

    sched, off, outs, p = off_after_first_turn(tiny_model_dir, draft_dir)
    base = p + outs["t0"]["output_ids"]
    b1, b2 = base + prompt(5, seed=2), base + prompt(5, seed=3)
    for rid, ids in (("b1", b1), ("b2", b2)):
        submit(sched, rid, ids, GREEDY)
    run_until_idle(sched, outs)
    c = b1 + prompt(6, seed=7)  # b1's prompt, then not its answer
    assert len(b1) - len(base) <= MAX_BRANCH_CUT
    submit(sched, "c", c, GREEDY)
    sched.step()
    (req,) = sched.running
    # the branch (b1 or b2) is after token len(base) - 1: the prefix stops before that position
    assert len(req.prefix_indices) == len(base) - 1
    assert not req.draft.stale and not req.prefix_shares_branch
    off["value"] = False
    while not sched.is_idle():
        sched.step()
        collect(sched, outs)
        assert wrong_draft_entries(sched) == []
    assert outs["c"]["meta"]["spec_num_proposed_drafts"] > 0  # it caught up and drafted
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    ref: dict = {}
    for rid, ids in (("t0", p), ("b1", b1), ("b2", b2), ("c", c)):
        submit(plain, rid, ids, GREEDY)
        run_until_idle(plain, ref)
    assert all(outs[r]["output_ids"] == ref[r]["output_ids"] for r in ref)
    sched.kv.check_accounting()


def test_chunked_turn_on_a_target_only_prefix_stops_drafting(tiny_model_dir, draft_dir):
    """With chunked prefill, caching a turn's first chunk swaps the slot it computed for the
    prefix's last position back to the tree's shared one: that pending position now sits in
    a shared slot, so the request stops drafting (limit_draft_kv), and two such turns with
    different next tokens never write each other's entry (a review helper's case)."""
    sched, off, outs, p = off_after_first_turn(tiny_model_dir, draft_dir, chunked_prefill_size=16)
    cached = p + outs["t0"]["output_ids"][:-1]
    submit(sched, "b", cached + prompt(40, seed=2), GREEDY)
    submit(sched, "c", cached + prompt(40, seed=3), GREEDY)
    for _ in range(12):  # the chunked prefills, while off
        sched.step()
    assert {r.rid for r in sched.running} == {"b", "c"}
    assert all(r.draft.stale for r in sched.running)
    off["value"] = False
    while not sched.is_idle():
        sched.step()
        collect(sched, outs)
        assert wrong_draft_entries(sched) == []
    sched.kv.check_accounting()
