"""Abstract interface of the prefix caches (RadixCache, ChunkCache) that the scheduler calls.

Ownership of KV slots (page size 1). Every KV slot 1..size is owned by exactly one of:
  * the allocator's free list (TokenToKVPoolAllocator),
  * the prefix cache: slots stored as values in the tree (`total_size()` of them), or
  * a running request: slots written in its req_to_token row beyond its cached prefix.
So with no request running, `allocator.available_size() + cache.total_size() == allocator.size`.

The scheduler owns both pools; the cache is its helper. The cache frees slots to the allocator
(duplicates on insertion, evicted leaves) and rewrites req_to_token rows in
`cache_unfinished_req`, but never allocates or frees request slots (ReqToTokenPool).

Locking protocol (as upstream SGLang): the scheduler calls `match_prefix`, then
`inc_lock_ref(last_node)` once the request is admitted, and hands that `last_node` (or the one
returned by the latest `cache_unfinished_req`) back to `cache_*_req`, which release the lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import TreeNode


@dataclass
class MatchPrefixResult:
    """Result of `match_prefix`.

    device_indices: [n] int64 CPU, KV slots of the n longest cached prefix tokens of the key.
    last_node: the tree node where the match ends (a dummy node for ChunkCache).
    draft_valid_len: the first draft_valid_len <= n of them hold valid draft-model KV too
        (speculative decoding; n without it).
    """

    device_indices: torch.Tensor
    last_node: TreeNode
    draft_valid_len: int = 0


class BasePrefixCache(ABC):
    """What the scheduler may call on a prefix cache; see the module docstring for ownership."""

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator

    def _req_kv(self, req_pool_idx: int, num_tokens: int) -> torch.Tensor:
        """KV slots of a request's first num_tokens tokens: [num_tokens] int64, CPU."""
        return self.req_to_token_pool.read(req_pool_idx, 0, num_tokens)

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry without freeing slots (the scheduler clears the pools)."""

    @abstractmethod
    def match_prefix(self, key: list[int], draft_only: bool = False) -> MatchPrefixResult:
        """Longest cached prefix of `key` (token ids); refreshes its LRU access time. With
        draft_only, the longest whose draft-model KV is valid too."""

    @abstractmethod
    def cache_finished_req(
        self,
        req_pool_idx: int,
        token_ids: list[int],
        last_node: TreeNode,
        draft_valid_len: int | None = None,
    ) -> None:
        """Hand a finished request's KV to the cache and release its lock on `last_node`.

        req_to_token[req_pool_idx, :len(token_ids)] must hold the KV slots of `token_ids`. Slots
        beyond that and the request slot itself stay the scheduler's to free. The draft-model
        KV is valid for token_ids[:draft_valid_len] (None: all).
        """

    @abstractmethod
    def cache_unfinished_req(
        self,
        req_pool_idx: int,
        token_ids: list[int],
        last_node: TreeNode,
        draft_valid_len: int | None = None,
    ) -> tuple[torch.Tensor, TreeNode]:
        """Cache a running request's KV (after a prefill chunk); the request keeps a lock.

        Returns (prefix indices [len(token_ids)] int64 CPU, new last node, now locked).
        """

    def path_draft_valid_len(self, node: TreeNode, n: int) -> int:
        """Of the n tokens up to `node` (as returned by cache_unfinished_req), how many lead
        with valid draft-model KV in the slots the request now uses (all n by default)."""
        return n

    def first_branch_on_path(
        self,
        node: TreeNode,
        n: int,
        lo: int,
        hi: int,
        ends: Callable[[TreeNode, int], Iterable[int]] | None = None,
        key: list[int] | None = None,
    ) -> int | None:
        """The smallest e with lo < e <= hi after whose token e - 1 the cached path ending at
        `node` (at token n) continues in more than one way: the slot of position e - 1 is then
        shared by requests whose token e differs. ends(node, e): the next tokens of live
        requests whose cached prefix ends where `node` does, at token e (a chunked request's
        cached chunk: its next token is not in the tree); such a node counts as a branch where
        one of them differs from key[e] (key: the tokens of the path's request). None when
        there is none (always without a shared tree)."""
        return None

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (one more reference)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None:
        """Drop one reference taken by `inc_lock_ref(node)`."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free >= `num_tokens` slots if possible (LRU unlocked leaves); returns the count freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens in the cache that no request locks."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens in the cache locked by at least one request."""

    def total_size(self) -> int:
        """Tokens (= KV slots) held by the cache."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def pretty_print(self) -> None:
        """Print the cache contents (debugging)."""
