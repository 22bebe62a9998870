"""A catch-up (the first drafting step of a request admitted while speculation was off) writes
the draft KV of its pending positions into slots the radix cache shares; the entry of
position p depends on the token p + 1, so no request sharing that slot may continue
differently. BatchBuilder.match_prefix cuts a target-only prefix back before the first branch
of the cache (MAX_BRANCH_CUT) or leaves the request stale, but a running request whose prompt
was chunked also shares the slot of its cached chunk's last position, and its next token is
not in the tree (only its cached chunk is): no branch shows there.

The first two tests are that case (both failed at d8ec04f: a later request that took the chunk
and continued along another cached path caught up over that slot and overwrote the chunked
request's entry; BatchBuilder.chunk_end_tokens now counts such a slot as a branch). The first
needed the branch cut (before d8ec04f the request crossed a near branch and stayed stale); the
second did not (the hole was older than the cut). The last test is a compact randomized fuzz
(fixed seeds) of the cut: random multi-turn conversations and shared prefixes branching at
various depths, speculation switched off and on at random steps, chunked prefill and overlap
scheduling on in some runs, checking after every step that no catch-up writes a slot that
another running request reads with a different next token and that no request's entry turns
wrong, then the KV accounting and the plain engine's outputs.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_deferred_draft_extend import (
    GREEDY,
    draft_entry_checks,
    prompt,
    spec_scheduler,
    switch_speculation,
    wrong_draft_entries,
)

from sglang.srt.managers.batch_builder import MAX_BRANCH_CUT
from sglang.test.scheduler_utils import collect, make_scheduler, submit


def chunk_end_then_other_path(tiny_model_dir, draft_dir, near_branch: bool):
    """r0 = a + 3 tokens, a of 16 tokens: with chunked prefill (16) its first chunk, a, is
    cached target-only (speculation off) and r0 keeps running on that chunk's slots. r1 =
    a + b finishes, so the cache continues a with b (and, with near_branch, r1b = a + b[:6] + ...
    adds a branch 2 tokens before r1's end). r2 = r1 + 4 tokens, admitted while off, takes a
    prefix through a's last slot, which r0 shares with a different next token."""
    sched = spec_scheduler(tiny_model_dir, draft_dir, chunked_prefill_size=16)
    off = {"value": True}
    switch_speculation(sched, off)
    outs: dict = {}
    a, b = prompt(16, seed=1), prompt(8, seed=3)
    r0 = a + prompt(3, seed=2)
    submit(sched, "r0", r0, {**GREEDY, "max_new_tokens": 30})
    sched.step()
    sched.step()  # r0's two chunks: the first, a, is cached (target-only)
    firsts = {"r1": a + b}
    if near_branch:
        firsts["r1b"] = a + b[:6] + prompt(3, seed=5)
    for rid, ids in firsts.items():
        submit(sched, rid, ids, {**GREEDY, "max_new_tokens": 1})
    for _ in range(4):
        sched.step()
        collect(sched, outs)
    assert all(outs[rid]["finish"] is not None for rid in firsts)
    r2 = a + b + prompt(4, seed=4)
    submit(sched, "r2", r2, GREEDY)
    sched.step()
    running = {r.rid: r for r in sched.running}
    assert set(running) == {"r0", "r2"}
    assert not running["r0"].draft.stale
    return sched, off, outs, {"r0": r0, **firsts, "r2": r2}, running


@pytest.mark.parametrize("near_branch", [True, False])
def test_catch_up_never_overwrites_the_entry_of_a_running_chunk_end(
    tiny_model_dir, draft_dir, near_branch
):
    """r2 must not catch up over position 15, the slot r0 shares with it, whose entry r0 made
    with its own token 16: at d8ec04f r2 did, writing it with its token 16 (b[0]), and
    wrong_draft_entries found ('r0', 15). match_prefix now counts as a branch a node where a
    live request's cached chunk ends with a next token other than req's
    (BatchBuilder.chunk_end_tokens), so r2's prefix stops before position 15. With
    near_branch r2 can still draft (the cut), as the test checks."""
    sched, off, outs, prompts, running = chunk_end_then_other_path(
        tiny_model_dir, draft_dir, near_branch
    )
    r0, r2 = running["r0"], running["r2"]
    if near_branch:  # the cut: r2 stops before the branch after b[:6] and can draft
        assert len(r2.prefix_indices) <= 16 + 6 - 1 and not r2.draft.stale
    shared = sched.req_to_token_pool.read(r0.req_pool_idx, 15, 16)
    if not r2.draft.stale and len(r2.prefix_indices) > 15:
        assert torch.equal(sched.req_to_token_pool.read(r2.req_pool_idx, 15, 16), shared)
    off["value"] = False
    wrong: set = set()
    while not sched.is_idle():
        sched.step()
        collect(sched, outs)
        wrong |= set(wrong_draft_entries(sched))
    assert sorted(wrong) == []
    sched.kv.check_accounting()


# ------------------------------------------------------------------------------------ fuzz
def draft_entries(sched) -> dict:
    """{(rid, retractions, position): (slot, ok)} below each non-stale running request's
    draft_kv_len (draft_entry_checks, per entry)."""
    return {
        (r.rid, r.num_retractions, i): (int(slots[i]), bool(ok[i]))
        for r, slots, ok in draft_entry_checks(sched)
        for i in range(len(ok))
    }


def watch_catch_ups(sched, found: list) -> None:
    """Record in `found` every catch-up that writes a slot another non-stale request's row
    holds at that position while that request's next token there differs."""
    spec = sched.spec
    base = spec.build_plan

    def plan(batch):
        p = base(batch)
        if not p.catchup_ids:
            return p
        reqs = {id(r): r for r in [*sched.running, *batch.reqs, sched.chunked_req] if r}
        rows = {
            k: sched.req_to_token_pool.read_np(r.req_pool_idx, 0, r.kv_len)
            for k, r in reqs.items()
            if r.req_pool_idx is not None and not r.draft.stale
        }
        lists = (batch.reqs, p.catchup_prefix_lens, p.catchup_slots)
        for req, lo, slots in zip(*lists, strict=True):
            for k, row in rows.items():
                other = reqs[k]
                if other is req or slots is None:
                    continue
                for j, slot in enumerate(slots):
                    q = lo + j
                    if q < len(row) and row[q] == slot and q + 1 < len(other.fill_ids):
                        if other.fill_ids[q + 1] != req.fill_ids[q + 1]:
                            found.append(("shared slot", req.rid, other.rid, q))
        return p

    spec.build_plan = plan


def fuzz_case(seed: int, tiny_model_dir: str, draft_dir: str) -> dict:
    rng = random.Random(seed)
    chunked, overlap = rng.random() < 0.4, rng.random() < 0.5
    template = rng.random() < 0.5
    kw = {"disable_overlap_schedule": not overlap}
    if chunked:
        kw["chunked_prefill_size"] = 16
    sched = spec_scheduler(tiny_model_dir, draft_dir, **kw)
    off = {"value": True}
    switch_speculation(sched, off)
    found: list = []
    watch_catch_ups(sched, found)
    chunked_reqs: set = set()  # their own recomputed entries may be swapped (a known gap)
    base_limit = sched.spec.limit_draft_kv

    def limit(req, *a, **k):
        chunked_reqs.add((req.rid, req.num_retractions))
        return base_limit(req, *a, **k)

    sched.spec.limit_draft_kv = limit
    cuts = []  # requests whose target-only prefix stopped before a near branch
    base_branch = sched.tree_cache.first_branch_on_path

    def first_branch(node, n, lo, hi, *a):
        e = base_branch(node, n, lo, hi, *a)
        if e is not None and hi - (e - 1) <= MAX_BRANCH_CUT:
            cuts.append(e)
        return e

    sched.tree_cache.first_branch_on_path = first_branch

    def fresh(k: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(k)]

    base = fresh(rng.randint(8, 40))
    starts = [fresh(rng.randint(1, 24)) for _ in range(3)]
    known, conv, active = [base], {}, {}
    submitted, outs, seen_ok, first_wrong = {}, {}, {}, set()
    nconv = rng.randint(4, 8) if template else rng.randint(2, 5)
    max_reqs, nreq, steps = rng.randint(8, 20), 0, 0

    def new_prompt(c: int) -> list[int]:
        if template and (c not in conv or rng.random() < 0.5):  # shared head, near branches
            st = rng.choice(starts)
            return base + st[: rng.randint(1, len(st))] + fresh(rng.randint(1, 20))
        if c in conv and rng.random() < 0.5:  # the conversation's next turn
            return conv[c] + fresh(rng.randint(1, 12))
        src = rng.choice(known)
        k = max(1, len(src) - rng.randint(0, 24)) if rng.random() < 0.6 else len(src)
        return src[: rng.randint(1, k)] + fresh(rng.randint(1, 20))

    while not (sched.is_idle() and not active and nreq >= max_reqs):
        for c in range(nconv):
            if c not in active and nreq < max_reqs and rng.random() < 0.5:
                rid, p = f"r{nreq}", new_prompt(c)[:400]
                params = {**GREEDY, "max_new_tokens": rng.randint(2, 20)}
                submit(sched, rid, p, params)
                submitted[rid], active[c] = (p, params), rid
                known.append(p)
                nreq += 1
        if rng.random() < (0.12 if off["value"] else 0.3):
            off["value"] = not off["value"]
        sched.step()
        steps += 1
        assert steps < 3000
        collect(sched, outs)
        for c, rid in list(active.items()):
            if outs.get(rid, {}).get("finish") is not None:
                conv[c] = submitted[rid][0] + outs[rid]["output_ids"]
                known.append(conv[c])
                del active[c]
        for key, (slot, ok) in draft_entries(sched).items():
            if ok:
                seen_ok[key] = slot
                continue
            assert seen_ok.get(key) != slot, ("overwritten", seed, key)
            if key not in first_wrong:  # an entry inherited from the cache (a known gap)
                first_wrong.add(key)
                req = next(r for r in sched.running if r.rid == key[0])
                own = key[2] >= req.prefix_draft_valid_len
                assert not own or key[:2] in chunked_reqs, ("own entry wrong", seed, key)
        assert found == [], (seed, found)
    sched.kv.check_accounting()
    plain = make_scheduler(tiny_model_dir, dtype="float32")
    ref: dict = {}
    for rid, (p, params) in submitted.items():
        submit(plain, rid, p, params)
    while not plain.is_idle():
        plain.step()
        collect(plain, ref)
    for rid in submitted:
        assert outs[rid]["output_ids"] == ref[rid]["output_ids"], (seed, rid)
    return {
        "cuts": len(cuts),
        "drafting_steps": sched.spec.stats["spec_drafting_steps"],
        "chunked": chunked,
        "overlap": overlap,
    }


FUZZ_SEEDS = [0, 14, 24, 30, 42, 43, 45, 49, 50, 52, 55, 56]  # cuts in each; all four settings


def test_branch_cut_fuzz(tiny_model_dir, draft_dir):
    runs = [fuzz_case(seed, tiny_model_dir, draft_dir) for seed in FUZZ_SEEDS]
    assert sum(r["cuts"] for r in runs) > 0 and all(r["drafting_steps"] for r in runs)


def test_chunk_end_tokens_take_only_prefixes_that_end_at_the_node():
    """Only a live request whose cached prefix ends exactly at the node's end gives its next
    token (read from its prompt or its outputs); one whose prefix stopped short of the node
    (as target-only and draft-valid prefixes with children do) does not, and neither does one
    without a node. Grouped once per prefill batch: a later request joining is not seen until
    the grouping is reset. The chunked request that the batch continues counts too."""
    from types import SimpleNamespace

    from sglang.srt.managers.batch_builder import BatchBuilder
    from sglang.srt.managers.schedule_batch import Req

    node, other = object(), object()

    class FakeReq(SimpleNamespace):  # Req's own token accessors over the fields set below
        fill_ids_slice = Req.fill_ids_slice
        seqlen = Req.seqlen

    def req(prefix_len, node, prompt, outputs=()):
        return FakeReq(
            prefix_indices=torch.zeros(prefix_len, dtype=torch.int64),
            last_node=node,
            origin_input_ids=list(prompt),
            output_ids=list(outputs),
        )

    at_end = req(4, node, [1, 2, 3, 4, 5, 6])  # next token 5
    short = req(3, node, [1, 2, 3, 4, 9])  # stops one short: not at the node's end
    in_outputs = req(4, node, [1, 2, 3, 4], outputs=[7, 8])  # next token 7, an output
    done = req(4, node, [1, 2, 3, 4])  # nothing after its prefix yet
    elsewhere = req(4, other, [1, 2, 3, 4, 6])
    chunked = req(4, node, [1, 2, 3, 4, 11, 12])
    sched = SimpleNamespace(
        running=[at_end, short, in_outputs, done, elsewhere], inflight=None, chunked_req=chunked
    )
    b = BatchBuilder.__new__(BatchBuilder)
    b.s, b._by_node, b._continuing = sched, None, None
    assert sorted(b.chunk_end_tokens(node, 4)) == [5, 7, 11]
    assert b.chunk_end_tokens(other, 4) == [6]
    sched.running.append(req(4, node, [1, 2, 3, 4, 13]))
    assert sorted(b.chunk_end_tokens(node, 4)) == [5, 7, 11]  # the batch's grouping
    b._by_node = None
    assert sorted(b.chunk_end_tokens(node, 4)) == [5, 7, 11, 13]
    # the chunked request a prefill batch continues is no longer chunked_req but still counts
    sched.chunked_req, b._continuing, b._by_node = None, chunked, None
    assert sorted(b.chunk_end_tokens(node, 4)) == [5, 7, 11, 13]
