"""RadixCache: a radix tree from token-id prefixes to KV slots, with LRU eviction (page size 1).

Algorithm as upstream SGLang (RadixAttention, Zheng et al. 2024, "SGLang: Efficient Execution of
Structured Language Model Programs", section 3): each edge holds a run of token ids (`key`) and
their KV slots (`value`, [len(key)] int64 CPU); children are keyed by their first token id.
Nodes are split when a match or an insertion ends in the middle of an edge. Requests lock the path
to their last node (`lock_ref`); only unlocked leaves are evicted, oldest access first.

Ownership: slots stored in the tree belong to the cache until evicted (then freed to the
allocator). See base_prefix_cache.py for the full ownership and locking contract.

Draft KV (speculative decoding; not upstream): the draft model's KV lives at the same slots as
the target's, and a request's draft may lag behind its target KV (positions decoded or
prefilled while it did not draft). Each node records whether its slots hold valid draft KV too
(`draft_ok`). A request inserts its target KV with the length of its draft-valid prefix: edges
past it are added with draft_ok False (split at the boundary), so the target KV is cached as
a plain server would cache it. A later insert whose draft is valid over a draft_ok False edge
that no request locks upgrades it: the tree takes that request's slots and frees its own
(or, when the slots are already the request's own, just marks them).
`match_prefix(key, draft_only=True)` stops at the first such edge (a request that will draft
recomputes the rest); every match reports `draft_valid_len`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchPrefixResult

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

_EMPTY = torch.empty(0, dtype=torch.int64)
_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree (the root has an empty key and never gets evicted)."""

    def __init__(self) -> None:
        self.id = next(_node_ids)
        self.parent: TreeNode | None = None
        self.children: dict[int, TreeNode] = {}  # first token id of the child's key -> child
        self.key: list[int] = []  # token ids of this edge
        self.value: torch.Tensor = _EMPTY  # [len(key)] int64 CPU, KV slots of `key`
        self.lock_ref = 0  # number of requests whose locked path goes through this node
        self.draft_ok = True  # `value` slots hold the draft model's KV of `key` too
        self.last_access_time = 0  # logical clock of the cache (larger = more recent)

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    """Prefix cache shared by all requests; see the module docstring."""

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator)
        self.reset()

    # ---- bookkeeping -------------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode()
        self._clock = 0
        self._evictable_size = 0
        self._protected_size = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    # ---- lookup and insertion ----------------------------------------------------------------
    def match_prefix(self, key: list[int], draft_only: bool = False) -> MatchPrefixResult:
        """Longest cached prefix of `key` (with draft_only, longest whose draft KV is valid).

        Returns MatchPrefixResult(device_indices [n] int64 CPU, last_node, draft_valid_len)
        where n is the prefix length; last_node ends exactly at token n (an edge is split if
        the match stops inside it); the first draft_valid_len <= n tokens have valid draft KV.
        Every node on the path gets a fresh access time. Does not lock anything.
        """
        now = self._tick()
        node, values, pos = self.root, [], 0
        draft_valid = None  # position of the first draft_ok False edge on the path
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None or (draft_only and not child.draft_ok):
                break
            n = _common_prefix_len(child.key, key[pos : pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            if not child.draft_ok and draft_valid is None:
                draft_valid = pos
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + n
        indices = torch.cat(values) if values else _EMPTY.clone()
        valid = pos if draft_valid is None else draft_valid
        return MatchPrefixResult(device_indices=indices, last_node=node, draft_valid_len=valid)

    def path_draft_valid_len(self, node: TreeNode, n: int) -> int:
        """Tokens from the root to `node` (which ends at token n) before the first edge whose
        draft KV is not valid (n when all are)."""
        valid, depth = n, n
        while node.parent is not None:
            depth -= len(node.key)
            if not node.draft_ok:
                valid = depth
            node = node.parent
        return valid

    def first_branch_on_path(
        self,
        node: TreeNode,
        n: int,
        lo: int,
        hi: int,
        ends: Callable[[TreeNode, int], Iterable[int]] | None = None,
        key: list[int] | None = None,
    ) -> int | None:
        """See BasePrefixCache.first_branch_on_path: the smallest end e of a node on the path
        with lo < e <= hi and more than one child, or a live request's next token there
        (ends) other than key[e]."""
        end, first = n, None
        while node.parent is not None and end > lo:
            if end <= hi and (
                len(node.children) > 1
                or (ends is not None and any(t != key[end] for t in ends(node, end)))
            ):
                first = end  # walking up: each one found is smaller
            end -= len(node.key)
            node = node.parent
        return first

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens (0 < n < len); returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode()
        upper.parent = parent
        upper.key, upper.value = child.key[:n], child.value[:n]
        upper.lock_ref = child.lock_ref  # same set of requests goes through both halves
        upper.draft_ok = child.draft_ok
        upper.last_access_time = child.last_access_time
        upper.children = {child.key[n]: child}
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        parent.children[upper.key[0]] = upper
        return upper

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert token ids `key` with KV slots `value` ([len(key)] int64 CPU), draft KV valid
        for all of them (existing edges keep their slots: nothing is upgraded).

        Returns how many leading tokens were already cached: value[:returned] is NOT taken by the
        tree (the caller frees what it owns of it); value[returned:] now belongs to the tree.
        """
        return self._insert(key, value, len(key), upgrade=False)[0]

    def _insert(
        self, key: list[int], value: torch.Tensor, draft_valid_len: int, upgrade: bool = True
    ) -> tuple[int, torch.Tensor, TreeNode]:
        """insert() with draft KV valid for key[:draft_valid_len], also returning the tree's
        slots for `key` ([len(key)] int64 CPU) and the node that ends exactly at len(key).

        New edges past draft_valid_len get draft_ok False. With `upgrade`, an existing
        draft_ok False edge inside key[:draft_valid_len] becomes draft_ok: as far as its slots
        are `value`'s (the caller's draft KV was written into the tree's slots: a chunked
        request that caught its draft up after cache_unfinished_req, or one that took a
        target-only prefix, which shares all but its last position), whoever locks it, the
        edge split where the slots start to differ; else when no request locks it, by taking
        `value`'s slots (the tree's own are freed): the tree's slots returned for it are then
        `value`'s, so a caller that frees value's slots where they differ from the tree's
        (_insert_req) keeps them."""
        assert len(key) == value.numel(), (len(key), value.numel())
        dv = draft_valid_len
        now = self._tick()
        node, pos, values = self.root, 0, []
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                cut = pos
                if pos < dv < len(key):  # the draft-valid part, then the rest below it
                    node = self._add_leaf(node, key[pos:dv], value[pos:dv].clone(), now, True)
                    values.append(node.value)
                    cut = dv
                node = self._add_leaf(node, key[cut:], value[cut:].clone(), now, cut < dv)
                values.append(node.value)
                break
            n = _common_prefix_len(child.key, key[pos : pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            if upgrade and not child.draft_ok and pos < dv:
                m = min(n, dv - pos)  # the part before the boundary is draft-valid
                same = child.value[:m] == value[pos : pos + m]
                own = m if bool(same.all()) else int(same.to(torch.int8).argmin())
                if own:  # its leading `own` slots are value's: their draft KV is the caller's
                    if own < n:
                        child, n = self._split(child, own), own
                    child.draft_ok = True
                elif child.lock_ref == 0:
                    if m < n:
                        child, n = self._split(child, m), m
                    self.token_to_kv_pool_allocator.free(child.value)
                    child.value = value[pos : pos + n].clone()
                    child.draft_ok = True
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + n
        tree_value = torch.cat(values) if values else _EMPTY.clone()
        return pos, tree_value, node

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int, draft_ok: bool
    ) -> TreeNode:
        leaf = TreeNode()
        leaf.parent, leaf.key, leaf.value = parent, key, value
        leaf.last_access_time = now
        leaf.draft_ok = draft_ok
        parent.children[key[0]] = leaf
        self._evictable_size += len(key)
        return leaf

    # ---- request hooks (called by the scheduler) ---------------------------------------------
    def _insert_req(
        self, req_pool_idx: int, token_ids: list[int], draft_valid_len: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, TreeNode]:
        """Insert req_to_token[req_pool_idx, :len(token_ids)] and free the request's duplicates.

        A duplicate is a position the tree already held (from another request) whose slot in the
        request's row differs from the tree's: it is the request's own and is freed. Comparing
        slots (rather than trusting the depth of the request's last node) stays exact when the
        scheduler used only part of a matched prefix.
        draft_valid_len: the request's draft KV is valid for token_ids[:draft_valid_len] (None:
        all of them).
        Returns (request row [n] int64 CPU, tree slots [n] int64 CPU, node ending at n).
        """
        n = len(token_ids)
        kv = self._req_kv(req_pool_idx, n)  # [n] int64 CPU
        dv = n if draft_valid_len is None else min(draft_valid_len, n)
        cached, tree_kv, node = self._insert(token_ids, kv, dv)
        dup = kv[:cached] != tree_kv[:cached]  # [cached] bool
        self.token_to_kv_pool_allocator.free(kv[:cached][dup])
        return kv, tree_kv, node

    def cache_finished_req(
        self,
        req_pool_idx: int,
        token_ids: list[int],
        last_node: TreeNode,
        draft_valid_len: int | None = None,
    ) -> None:
        """Insert a finished request's tokens, free its duplicate slots, unlock `last_node`.

        Slots of tokens that the tree already held under other slots (cached meanwhile by another
        request) are duplicates and go back to the allocator; the rest now belong to the tree.
        The request slot and any slot past len(token_ids) stay the scheduler's to free.
        draft_valid_len: see the module docstring (None: draft KV valid for all tokens).
        The request's lock is released first, so that its own lock does not keep a draft_ok
        False edge it holds valid draft KV for from being upgraded (_insert: only edges that
        other requests lock keep their slots).
        """
        self.dec_lock_ref(last_node)
        self._insert_req(req_pool_idx, token_ids, draft_valid_len)

    def cache_unfinished_req(
        self,
        req_pool_idx: int,
        token_ids: list[int],
        last_node: TreeNode,
        draft_valid_len: int | None = None,
    ) -> tuple[torch.Tensor, TreeNode]:
        """Insert a running request's tokens so far; it then uses the tree's slots for all of them.

        Frees duplicate slots, rewrites req_to_token[req_pool_idx, :len(token_ids)] with the
        tree's slots, locks the new last node and unlocks `last_node`. After the rewrite the
        request's draft KV is valid only as far as path_draft_valid_len(new node) says (a
        draft_ok False edge that another request locks is not upgraded).
        Returns (prefix indices [len(token_ids)] int64 CPU, new last node).
        """
        kv, tree_kv, new_node = self._insert_req(req_pool_idx, token_ids, draft_valid_len)
        changed = (kv != tree_kv).nonzero()  # [num_changed, 1]
        if changed.numel() > 0:
            first = int(changed[0, 0])
            self.req_to_token_pool.write(req_pool_idx, first, tree_kv[first:])
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(last_node)
        return tree_kv, new_node

    # ---- locking -----------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, f"dec_lock_ref below zero on {node}"
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------
    def _evictable_leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                if node is not self.root and node.lock_ref == 0:
                    leaves.append(node)
            else:
                stack.extend(node.children.values())
        return leaves

    def evict(self, num_tokens: int) -> int:
        """Evict least-recently-accessed unlocked leaves until `num_tokens` slots are freed.

        Whole edges are evicted, so more than `num_tokens` may be freed; fewer when nothing
        evictable remains. A parent left childless and unlocked becomes a candidate in turn.
        Returns the number of slots freed to the allocator.
        """
        heap = self._evictable_leaves()
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_freed

    # ---- debugging ---------------------------------------------------------------------------
    def pretty_print(self) -> None:
        stack = [(self.root, 0)]
        while stack:
            node, indent = stack.pop()
            head = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            print(
                f"{' ' * indent}[{len(node.key)}] key={head}{more} lock_ref={node.lock_ref} "
                f"t={node.last_access_time}"
            )
            stack.extend((c, indent + 2) for c in node.children.values())
        print(f"total={self.total_size()} evictable={self.evictable_size()}")
