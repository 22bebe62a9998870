"""RadixCache and ChunkCache against exact allocator / tree counts (pure CPU).

A small fake scheduler (`Sim`) drives the caches the way the real one does: match_prefix,
inc_lock_ref, allocate the rest, write req_to_token, cache_unfinished_req per chunk,
cache_finished_req at the end. A shadow dict slot -> token id checks that cached slots really hold
the tokens of the key they are matched for.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode


@dataclass
class Req:
    tokens: list[int]
    pool_idx: int
    prefix_len: int  # tokens whose slots belong to the tree (locked through last_node)
    filled: int  # tokens whose KV slots are written in req_to_token
    last_node: TreeNode


class Sim:
    """Fake scheduler owning the pools; `shadow` records which token each live slot holds."""

    def __init__(self, size: int = 64, num_reqs: int = 8, ctx: int = 64, radix: bool = True):
        self.size = size
        self.req_pool = ReqToTokenPool(num_reqs, ctx, "cpu")
        self.alloc = TokenToKVPoolAllocator(size)
        cls = RadixCache if radix else ChunkCache
        self.cache = cls(self.req_pool, self.alloc)
        self.shadow: dict[int, int] = {}
        self.running: list[Req] = []

    def start(self, tokens: list[int], limit: int | None = None, draft_only: bool = False) -> Req:
        """Admit a request; like our scheduler, it may use only `limit` tokens of the match
        (e.g. seqlen - 1) while locking the node where the whole match ends; with draft_only,
        the match stops where the cached draft KV does."""
        m = self.cache.match_prefix(tokens, draft_only=draft_only)
        self.cache.inc_lock_ref(m.last_node)
        (pool_idx,) = self.req_pool.alloc(1)
        prefix = m.device_indices[:limit]
        self.req_pool.write(pool_idx, 0, prefix)
        n = prefix.numel()
        req = Req(tokens, pool_idx, prefix_len=n, filled=n, last_node=m.last_node)
        self.running.append(req)
        return req

    def compute(self, req: Req, n: int) -> bool:
        """Allocate and 'compute' KV for the next n tokens; False when memory is short."""
        n = min(n, len(req.tokens) - req.filled)
        if self.alloc.available_size() < n:
            self.cache.evict(n - self.alloc.available_size())
        slots = self.alloc.alloc(n)
        if slots is None:
            return False
        for s, t in zip(slots.tolist(), req.tokens[req.filled : req.filled + n], strict=True):
            self.shadow[s] = t
        self.req_pool.write(req.pool_idx, req.filled, slots)
        req.filled += n
        return True

    def cache_chunk(self, req: Req) -> torch.Tensor:
        idx, req.last_node = self.cache.cache_unfinished_req(
            req.pool_idx, req.tokens[: req.filled], req.last_node
        )
        req.prefix_len = req.filled
        return idx

    def finish(self, req: Req, draft_valid_len: int | None = None) -> None:
        self.cache.cache_finished_req(
            req.pool_idx, req.tokens[: req.filled], req.last_node, draft_valid_len
        )
        self.req_pool.free(req.pool_idx)
        self.running.remove(req)

    def cache_request(self, tokens: list[int], draft_valid_len: int | None = None) -> list[int]:
        """A request that takes its cached prefix, computes the rest of `tokens` and finishes
        with draft KV valid for draft_valid_len of them (None: all). Returns its slots."""
        req = self.start(tokens)
        assert self.compute(req, len(tokens))
        slots = self.row(req)
        self.finish(req, draft_valid_len)
        return slots

    def row(self, req: Req) -> list[int]:
        return self.req_pool.req_to_token[req.pool_idx, : req.filled].tolist()

    def check(self) -> None:
        """Every slot is owned exactly once; tree counters equal a walk of the tree."""
        tree_slots, evictable, protected = [], 0, 0
        stack = (
            list(self.cache.root.children.values()) if isinstance(self.cache, RadixCache) else []
        )
        while stack:
            node = stack.pop()
            assert len(node.key) == node.value.numel() > 0
            assert node.value.dtype == torch.int64
            tree_slots += node.value.tolist()
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            stack.extend(node.children.values())
        assert (evictable, protected) == (self.cache.evictable_size(), self.cache.protected_size())
        assert len(tree_slots) == self.cache.total_size()
        owned = [s for r in self.running for s in self.row(r)[r.prefix_len :]]
        everything = self.alloc.free_slots.tolist() + tree_slots + owned
        assert sorted(everything) == list(range(1, self.size + 1))
        in_tree = set(tree_slots)
        for r in self.running:  # locked prefixes use the tree's slots, which hold their tokens
            assert all(s in in_tree for s in self.row(r)[: r.prefix_len])
            for s, t in zip(self.row(r), r.tokens[: r.filled], strict=True):
                assert self.shadow[s] == t


def run_req(sim: Sim, tokens: list[int]) -> Req:
    req = sim.start(tokens)
    assert sim.compute(req, len(tokens))
    sim.finish(req)
    return req


def test_insert_match_split_mid_edge():
    sim = Sim()
    run_req(sim, [1, 2, 3, 4, 5])
    slots5 = sim.cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist()
    assert slots5 == [1, 2, 3, 4, 5]
    m = sim.cache.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == [1, 2, 3]
    assert m.device_indices.dtype == torch.int64
    assert m.last_node.key == [1, 2, 3]
    (lower,) = m.last_node.children.values()
    assert lower.key == [4, 5] and lower.value.tolist() == [4, 5]
    assert sim.cache.total_size() == 5
    assert sim.cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_indices.tolist() == [1, 2, 3, 4, 5]
    # A branching request shares [1, 2] and splits [1, 2, 3] again.
    run_req(sim, [1, 2, 7])
    assert sim.cache.match_prefix([1, 2, 7, 8]).device_indices.tolist() == [1, 2, 6]
    assert sim.cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [1, 2, 3, 4]
    assert sim.cache.total_size() == 6
    assert sim.alloc.available_size() == 64 - 6
    sim.check()


def test_match_missing_key_and_empty_key():
    sim = Sim()
    run_req(sim, [1, 2, 3])
    for key in ([7, 8], [], [2, 1]):
        m = sim.cache.match_prefix(key)
        assert m.device_indices.numel() == 0 and m.device_indices.dtype == torch.int64
        assert m.last_node is sim.cache.root
    assert sim.cache.total_size() == 3


def test_duplicate_insertion_frees_duplicates():
    sim = Sim(size=32)
    a = sim.start([1, 2, 3, 4, 5])
    b = sim.start([1, 2, 3, 4, 5])  # both miss: each computes its own 5 slots
    c = sim.start([1, 2, 3, 7, 8])
    for r in (a, b, c):
        assert sim.compute(r, 5)
    assert sim.alloc.available_size() == 32 - 15
    sim.finish(a)
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (5, 32 - 15)
    sim.check()
    sim.finish(b)  # all 5 duplicates freed
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (5, 32 - 10)
    sim.check()
    sim.finish(c)  # 3 duplicates freed, [7, 8] inserted
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (7, 32 - 7)
    assert sim.cache.match_prefix([1, 2, 3, 7, 8]).device_indices.tolist() == [1, 2, 3, 14, 15]
    sim.check()


def test_lock_ref_protects_from_eviction():
    sim = Sim(size=16)
    run_req(sim, [1, 2, 3, 4, 5])
    run_req(sim, [9, 9])
    req = sim.start([1, 2, 3, 4, 5, 6])  # locks the 5-token path
    assert req.prefix_len == 5
    assert (sim.cache.protected_size(), sim.cache.evictable_size()) == (5, 2)
    sim.cache.match_prefix([1, 2, 8])  # split inside a locked edge keeps counts
    assert (sim.cache.protected_size(), sim.cache.evictable_size()) == (5, 2)
    sim.check()
    assert sim.cache.evict(100) == 2
    assert sim.cache.match_prefix([1, 2, 3, 4, 5]).device_indices.numel() == 5
    assert sim.cache.match_prefix([9, 9]).device_indices.numel() == 0
    sim.cache.dec_lock_ref(req.last_node)
    assert (sim.cache.protected_size(), sim.cache.evictable_size()) == (0, 5)
    assert sim.cache.evict(1) == 3  # whole leaf edge [3, 4, 5]
    assert sim.cache.evict(1) == 2  # then its parent [1, 2]
    assert sim.cache.total_size() == 0 and sim.alloc.available_size() == 16
    with pytest.raises(AssertionError):
        sim.cache.dec_lock_ref(req.last_node)


def test_lru_order_of_eviction():
    sim = Sim()
    run_req(sim, [1, 1, 1])
    run_req(sim, [2, 2])
    run_req(sim, [3, 3, 3, 3])
    sim.cache.match_prefix([1, 1, 1])  # A is now the most recent
    assert sim.cache.evict(2) == 2  # B is the oldest
    assert sim.cache.match_prefix([2, 2]).device_indices.numel() == 0
    assert sim.cache.evict(1) == 4  # then C
    assert sim.cache.match_prefix([3]).device_indices.numel() == 0
    run_req(sim, [4])
    # Matching [1, 1] splits A into [1, 1] -> [1]; the leaf [1] keeps its old access time,
    # so it goes before [4] and before its refreshed parent.
    assert sim.cache.match_prefix([1, 1]).device_indices.tolist() == [1, 2]
    assert sim.cache.evict(1) == 1
    assert sim.cache.match_prefix([1, 1, 1]).device_indices.tolist() == [1, 2]
    assert sim.cache.match_prefix([4]).device_indices.numel() == 1
    sim.check()


def test_evict_more_than_available():
    sim = Sim(size=20)
    run_req(sim, [1, 2, 3])
    run_req(sim, [1, 2, 4, 5])
    run_req(sim, [6])
    assert sim.cache.total_size() == 6
    assert sim.cache.evict(1000) == 6
    assert sim.cache.evict(5) == 0
    assert sim.cache.total_size() == 0 and sim.alloc.available_size() == 20
    sim.check()


def test_chunked_requests_keep_counts_exact():
    sim, size = Sim(size=40), 40
    toks = list(range(100, 110))
    a = sim.start(toks)
    assert sim.compute(a, 4)
    assert sim.cache_chunk(a).tolist() == [1, 2, 3, 4]
    assert (sim.cache.protected_size(), sim.alloc.available_size()) == (4, size - 4)
    b = sim.start(toks)  # shares A's first chunk, computes the rest itself
    assert b.prefix_len == 4 and sim.row(b) == [1, 2, 3, 4]
    assert sim.compute(b, 6)
    assert sim.compute(a, 4)
    sim.cache_chunk(a)  # A caches tokens 0..7
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (8, size - 14)
    sim.check()
    b_idx = sim.cache_chunk(b)  # B's slots for tokens 4..7 are duplicates
    assert b_idx.tolist() == [1, 2, 3, 4, 11, 12, 13, 14, 9, 10]
    assert sim.row(b) == b_idx.tolist()
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (10, size - 10)
    assert sim.cache.protected_size() == 10
    sim.check()
    assert sim.compute(a, 2)
    sim.finish(a)  # A's slots for tokens 8, 9 are duplicates of B's
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (10, size - 10)
    assert sim.cache.protected_size() == 10
    sim.finish(b)
    assert (sim.cache.protected_size(), sim.cache.evictable_size()) == (0, 10)
    assert sim.alloc.available_size() + sim.cache.total_size() == size
    sim.check()
    sim.cache.reset()
    assert sim.cache.total_size() == 0 and sim.cache.match_prefix(toks).device_indices.numel() == 0


def test_partly_used_prefix_frees_recomputed_slots():
    sim = Sim(size=20)
    run_req(sim, [1, 2, 3, 4, 5, 6])
    a = sim.start([1, 2, 3, 4, 5, 6], limit=5)  # recomputes token 6 for its logits
    b = sim.start([1, 2, 3, 4, 5, 6, 7, 8], limit=3)
    assert (a.prefix_len, b.prefix_len) == (5, 3)
    assert sim.cache.protected_size() == 6
    assert sim.compute(a, 1) and sim.compute(b, 5)
    assert sim.alloc.available_size() == 20 - 12
    assert sim.cache_chunk(b).tolist() == [1, 2, 3, 4, 5, 6, 11, 12]
    assert sim.row(b) == [1, 2, 3, 4, 5, 6, 11, 12]
    assert sim.alloc.available_size() == 20 - 9  # b's copies of tokens 4..6 freed
    sim.check()
    sim.finish(a)  # a's copy of token 6 freed
    sim.finish(b)
    assert (sim.cache.total_size(), sim.alloc.available_size()) == (8, 20 - 8)
    assert sim.cache.protected_size() == 0
    sim.check()


def test_chunk_cache_frees_everything():
    sim = Sim(size=16, radix=False)
    a = sim.start([1, 2, 3, 4, 5, 6])
    assert a.prefix_len == 0
    assert sim.compute(a, 4)
    assert sim.cache_chunk(a).tolist() == [1, 2, 3, 4]
    assert sim.alloc.available_size() == 12
    b = sim.start([1, 2, 3, 4])  # nothing shared
    assert b.prefix_len == 0
    assert sim.compute(a, 2) and sim.compute(b, 4)
    sim.finish(a)
    assert sim.alloc.available_size() == 12
    sim.finish(b)
    assert sim.alloc.available_size() == 16
    assert sim.cache.total_size() == 0 and sim.cache.evict(10) == 0


def _assert_match_consistent(sim: Sim, key: list[int]) -> None:
    idx = sim.cache.match_prefix(key).device_indices.tolist()
    assert [sim.shadow[s] for s in idx] == key[: len(idx)]


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_random_requests_sharing_prefixes(data):
    sim = Sim(size=48, num_reqs=4, ctx=32)
    prefixes = data.draw(st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=3))
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["start", "compute", "chunk", "finish", "evict", "match"]))
        if op == "start" and sim.req_pool.available_size() > 0:
            base = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(0, 3), min_size=1 if not base else 0, max_size=8))
            _assert_match_consistent(sim, base + tail)
            sim.start(base + tail, limit=data.draw(st.one_of(st.none(), st.integers(0, 8))))
        elif op in ("compute", "chunk", "finish") and sim.running:
            req = data.draw(st.sampled_from(sim.running))
            if op == "compute" and not sim.compute(req, data.draw(st.integers(1, 8))):
                assert sim.cache.evictable_size() == 0  # short only when nothing can go
            elif op == "chunk":
                idx = sim.cache_chunk(req)
                assert [sim.shadow[s] for s in idx.tolist()] == req.tokens[: req.filled]
            elif op == "finish":
                sim.finish(req)
        elif op == "evict":
            before = sim.cache.evictable_size()
            freed = sim.cache.evict(data.draw(st.integers(0, 20)))
            assert sim.cache.evictable_size() == before - freed
        elif op == "match":
            key = data.draw(st.sampled_from(prefixes)) + data.draw(st.lists(st.integers(0, 3)))
            _assert_match_consistent(sim, key)
        sim.check()
    for req in list(sim.running):
        sim.finish(req)
    sim.check()
    assert sim.cache.protected_size() == 0
    assert sim.alloc.available_size() + sim.cache.total_size() == sim.size


def test_allocator_stack_order_reuse_and_double_free():

    a = TokenToKVPoolAllocator(8)
    first = a.alloc(3)
    assert first.tolist() == [1, 2, 3] and a.available_size() == 5
    second = a.alloc(2)
    assert second.tolist() == [4, 5]
    a.free(first)
    assert a.available_size() == 6
    assert a.alloc(3).tolist() == [1, 2, 3]  # the freed run comes back in its order
    assert a.alloc(4) is None and a.available_size() == 3
    rest = a.alloc(3)
    assert sorted(rest.tolist()) == [6, 7, 8] and a.available_size() == 0
    a.free(rest)
    a.free(second)
    with pytest.raises(ValueError, match="double free"):
        a.free(torch.tensor([1, 2, 3, 4]))
    a.clear()
    assert a.available_size() == 8 and sorted(a.free_slots.tolist()) == list(range(1, 9))


def test_req_to_token_write_many_equals_one_write_per_request():
    a, b = ReqToTokenPool(4, 16, "cpu"), ReqToTokenPool(4, 16, "cpu")
    rows, starts, lens = [2, 0, 3], [5, 0, 9], [3, 1, 4]
    locs = torch.arange(100, 108, dtype=torch.int64)
    b.write_many(rows, starts, lens, locs)
    off = 0
    for r, s0, n in zip(rows, starts, lens, strict=True):
        a.write(r, s0, locs[off : off + n])
        off += n
    assert torch.equal(a.req_to_token, b.req_to_token)
    assert b.read(2, 5, 8).tolist() == [100, 101, 102] and b.read(3, 9, 13).tolist() == [
        104,
        105,
        106,
        107,
    ]
    b.write_many([], [], [], torch.empty(0, dtype=torch.int64))  # nothing to write
    # the device-table path (table and CPU mirror are different tensors, as on CUDA)
    c = ReqToTokenPool(4, 16, "cpu")
    c.req_to_token = c.req_to_token.clone()
    c.write_many(rows, starts, lens, locs)
    assert torch.equal(c.req_to_token, a.req_to_token)
    assert torch.equal(c.req_to_token_cpu, a.req_to_token)
    # a decode step (one token per request: the fast path), both table layouts
    for mirror in (False, True):
        d, e = ReqToTokenPool(4, 16, "cpu"), ReqToTokenPool(4, 16, "cpu")
        if mirror:
            d.req_to_token = d.req_to_token.clone()
        one = torch.tensor([7, 9, 11], dtype=torch.int64)
        d.write_many([3, 0, 2], [15, 4, 0], [1, 1, 1], one)
        for r, s0, v in zip([3, 0, 2], [15, 4, 0], one, strict=True):
            e.write(r, s0, v.view(1))
        assert torch.equal(d.req_to_token, e.req_to_token)
        assert torch.equal(d.req_to_token_cpu, e.req_to_token)


def _draft_ok_edges(cache: RadixCache) -> list[tuple[list[int], bool]]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append((node.key, node.draft_ok))
        stack.extend(node.children.values())
    return sorted(out)


def test_draft_valid_boundary_splits_matches_and_upgrades():
    """A request whose draft KV is valid for its first 3 of 6 tokens caches all 6 (target KV,
    as a plain server would), the last 3 marked draft-invalid: a plain match takes 6 and
    reports 3 draft-valid, a draft_only match stops at 3. A later request with valid draft KV
    over the same tokens, while nobody locks them, upgrades the edge: the tree takes its slots
    and frees its own."""
    sim = Sim()
    toks = [1, 2, 3, 4, 5, 6]
    a_slots = sim.cache_request(toks, draft_valid_len=3)
    sim.check()
    assert _draft_ok_edges(sim.cache) == [([1, 2, 3], True), ([4, 5, 6], False)]
    m = sim.cache.match_prefix(toks + [7])
    assert m.device_indices.tolist() == a_slots and m.draft_valid_len == 3
    m = sim.cache.match_prefix(toks + [7], draft_only=True)
    assert m.device_indices.tolist() == a_slots[:3] and m.draft_valid_len == 3
    assert sim.cache.path_draft_valid_len(m.last_node, 3) == 3

    # b recomputes tokens 4..8 (its match stopped where the draft KV did), draft-valid to 7
    b = sim.start(toks + [7, 8], draft_only=True)
    assert b.prefix_len == 3
    assert sim.compute(b, 5)
    b_slots = sim.row(b)
    free_before = sim.alloc.available_size()
    sim.finish(b, draft_valid_len=7)
    sim.check()
    # tokens 4-6 now use b's slots (draft-valid), a's were freed; 7 valid, 8 not
    assert sim.cache.match_prefix(b.tokens).device_indices.tolist() == b_slots
    assert sim.alloc.available_size() == free_before + 3
    assert set(a_slots[3:]) <= set(sim.alloc.free_slots.tolist())
    assert _draft_ok_edges(sim.cache) == [
        ([1, 2, 3], True),
        ([4, 5, 6], True),
        ([7], True),
        ([8], False),
    ]
    assert sim.cache.match_prefix(b.tokens, draft_only=True).draft_valid_len == 7


def test_locked_draft_invalid_edge_is_not_upgraded():
    """An edge without draft KV that a running request holds keeps its slots: a request with
    valid draft KV over it gives up its duplicates (as for any cached prefix) and, after a
    mid-prompt cache_unfinished_req, learns that its row's draft KV is valid only before it."""
    sim = Sim()
    toks = [1, 2, 3, 4, 5, 6]
    sim.cache_request(toks, draft_valid_len=2)
    holder = sim.start(toks + [9])  # takes the whole prefix, draft-invalid part included
    assert holder.prefix_len == 6
    c = sim.start(toks + [7], draft_only=True)
    assert c.prefix_len == 2
    assert sim.compute(c, 5)
    tree_before = _draft_ok_edges(sim.cache)
    sim.cache_chunk(c)  # c's draft KV is valid for all 7 of its tokens
    sim.check()
    assert _draft_ok_edges(sim.cache) == [([1, 2], True), ([3, 4, 5, 6], False), ([7], True)]
    assert tree_before[1] == ([3, 4, 5, 6], False)
    assert sim.cache.path_draft_valid_len(c.last_node, 7) == 2
    for r in list(sim.running):
        sim.finish(r)
    sim.check()


def test_own_draft_invalid_edge_is_marked_valid_though_locked():
    """A chunked request caches its first chunk before its draft caught up (draft-invalid,
    locked by itself); once its draft KV is valid in those same slots, its final insert marks
    the edge valid without moving any slot."""
    sim = Sim()
    toks = [1, 2, 3, 4, 5, 6]
    a = sim.start(toks)
    assert sim.compute(a, 4)
    a.last_node = sim.cache.cache_unfinished_req(a.pool_idx, toks[:4], a.last_node, 0)[1]
    a.prefix_len = 4
    assert _draft_ok_edges(sim.cache) == [([1, 2, 3, 4], False)]
    assert sim.compute(a, 2)
    row = sim.row(a)
    sim.finish(a, draft_valid_len=5)
    sim.check()
    assert _draft_ok_edges(sim.cache) == [([1, 2, 3, 4], True), ([5], True), ([6], False)]
    assert sim.cache.match_prefix(toks).device_indices.tolist() == row


def test_target_only_prefix_but_its_last_position_upgrades_when_finished():
    """A request that took a draft-invalid (target-only) prefix but its last position, caught
    its draft up in the shared slots and computed the last position in a slot of its own
    (SpecScheduler.on_admit, BatchBuilder.match_prefix): its insert marks the shared part
    draft-valid in place (split where the slots start to differ) and, since only its own
    lock held the rest, takes its own slot for the last position. Its own lock does not
    block that (cache_finished_req releases it first)."""
    sim = Sim()
    toks = [1, 2, 3, 4, 5, 6]
    a_slots = sim.cache_request(toks, draft_valid_len=0)  # decoded without drafting
    b = sim.start(toks + [7, 8], limit=5)  # the whole match is locked, 5 slots used
    assert b.prefix_len == 5 and sim.compute(b, 3)
    b_slots = sim.row(b)
    assert b_slots[:5] == a_slots[:5] and b_slots[5] != a_slots[5]
    sim.finish(b, draft_valid_len=8)
    sim.check()
    assert _draft_ok_edges(sim.cache) == [([1, 2, 3, 4, 5], True), ([6], True), ([7, 8], True)]
    assert sim.cache.match_prefix(toks + [7, 8], draft_only=True).device_indices.tolist() == (
        b_slots
    )
    assert a_slots[5] in sim.alloc.free_slots.tolist()


def test_shared_last_position_locked_by_another_request_keeps_its_slot():
    """As above while another running request holds the whole target-only prefix: the shared
    slots are still marked valid in place (every sharer computes their draft KV alike), but
    the last position keeps the tree's slot and stays draft-invalid, so the holder's entry
    there is not replaced."""
    sim = Sim()
    toks = [1, 2, 3, 4, 5, 6]
    a_slots = sim.cache_request(toks, draft_valid_len=0)
    holder = sim.start(toks + [9])
    assert holder.prefix_len == 6
    b = sim.start(toks + [7], limit=5)
    assert sim.compute(b, 2)
    sim.finish(b, draft_valid_len=7)
    sim.check()
    assert _draft_ok_edges(sim.cache) == [([1, 2, 3, 4, 5], True), ([6], False), ([7], True)]
    assert sim.cache.match_prefix(toks).device_indices.tolist() == a_slots
    sim.finish(holder)
    sim.check()


def test_first_branch_on_path():
    """first_branch_on_path(node, n, lo, hi): the smallest end e of a node on the path with
    lo < e <= hi that continues in more than one way, or None."""
    sim = Sim()
    for toks in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [1, 2, 3, 4, 5, 6, 7]):
        sim.cache_request(toks)
    m = sim.cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(m.device_indices) == 7
    # [1, 2, 3] branches (4 or 9) at e = 3; [4, 5, 6] continues with 7 only
    assert sim.cache.first_branch_on_path(m.last_node, 7, 0, 7) == 3
    assert sim.cache.first_branch_on_path(m.last_node, 7, 2, 3) == 3
    assert sim.cache.first_branch_on_path(m.last_node, 7, 3, 7) is None  # e = 3 is not > lo
    assert sim.cache.first_branch_on_path(m.last_node, 7, 0, 2) is None
    sim.cache_request([1, 2, 3, 4, 5, 8])  # a second branch, at e = 5 (6 or 8)
    m = sim.cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert sim.cache.first_branch_on_path(m.last_node, 7, 0, 7) == 3  # the smaller one
    assert sim.cache.first_branch_on_path(m.last_node, 7, 3, 7) == 5
    assert sim.cache.first_branch_on_path(m.last_node, 7, 3, 4) is None
    sim.check()
