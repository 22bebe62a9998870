"""ChunkCache: the prefix cache used with --disable-radix-cache; it never shares anything.

Every request keeps its own KV slots until it finishes, then they all go back to the allocator.
`total_size()` is always 0, so with no request running the allocator holds every slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchPrefixResult
from sglang.srt.mem_cache.radix_cache import TreeNode

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    """No-op prefix cache: empty matches, frees a finished request's slots."""

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator)
        self.reset()

    def reset(self) -> None:
        self.dummy_node = TreeNode()

    def match_prefix(self, key: list[int], draft_only: bool = False) -> MatchPrefixResult:
        """Always an empty match: ([0] int64 CPU, dummy node, 0)."""
        return MatchPrefixResult(torch.empty(0, dtype=torch.int64), self.dummy_node, 0)

    def cache_finished_req(
        self,
        req_pool_idx: int,
        token_ids: list[int],
        last_node: TreeNode,
        draft_valid_len: int | None = None,
    ) -> None:
        """Free req_to_token[req_pool_idx, :len(token_ids)] to the allocator."""
        self.token_to_kv_pool_allocator.free(self._req_kv(req_pool_idx, len(token_ids)))

    def cache_unfinished_req(
        self,
        req_pool_idx: int,
        token_ids: list[int],
        last_node: TreeNode,
        draft_valid_len: int | None = None,
    ) -> tuple[torch.Tensor, TreeNode]:
        """Returns (req_to_token[req_pool_idx, :len(token_ids)] as [n] int64 CPU, dummy node)."""
        return self._req_kv(req_pool_idx, len(token_ids)), self.dummy_node

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def pretty_print(self) -> None:
        print("ChunkCache: nothing cached")
