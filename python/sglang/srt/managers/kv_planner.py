"""KV bookkeeping for the scheduler: allocate slots for a step (evicting from the prefix cache
when needed), release finished requests, retract running ones when the pool runs out.

Every function here is called by the scheduler; the pools are the scheduler's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

# An eviction frees at least this share of the pool (when that much is evictable): each one
# walks the whole radix tree for its leaves, so with a full cache evicting exactly what every
# step needs costs that walk every step (CPU machine, tiny model at bs 16 once its 65,536-slot
# pool is full: get_next_batch_to_run 100 -> ~540 us per step, ~160 with this share;
# benchmark/results/warmup_heap_cpu.txt, fifth blocks). Upstream evicts exactly what is needed.
EVICT_MIN_SHARE = 1 / 128


class KVPlanner:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: BasePrefixCache,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache

    def available_with_eviction(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def alloc_tokens(self, need: int) -> torch.Tensor | None:
        """`need` KV slots ([need] int64 CPU), evicting unreferenced cache entries if needed:
        the least recently used ones, at least EVICT_MIN_SHARE of the pool per eviction (so
        that the tree walk of an eviction is paid once per that many tokens, not every step).
        None when even a full eviction leaves too few."""
        short = need - self.allocator.available_size()
        if short > 0:
            batch = int(self.allocator.size * EVICT_MIN_SHARE)
            self.tree_cache.evict(max(short, min(batch, self.tree_cache.evictable_size())))
        return self.allocator.alloc(need)

    def assign_slots(self, req: Req, start: int, slots: torch.Tensor) -> None:
        """Record that tokens [start, start + len(slots)) of req live in `slots`."""
        self.req_to_token_pool.write(req.req_pool_idx, start, slots)

    def assign_slots_many(self, reqs: list[Req], starts: list[int], lens: list[int], slots):
        """assign_slots for several requests at once: request i's tokens [starts[i],
        starts[i] + lens[i]) live in the i-th run of `slots` ([sum(lens)] int64)."""
        self.req_to_token_pool.write_many([r.req_pool_idx for r in reqs], starts, lens, slots)

    def req_slots_np(self, req: Req, start: int, end: int) -> np.ndarray:
        """KV slots ([end - start] int64, a numpy array: no torch call, per request in
        drafting steps) of tokens [start, end) of req."""
        return self.req_to_token_pool.read_np(req.req_pool_idx, start, end)

    def free_token_range(self, req: Req, start: int, end: int) -> None:
        """Free the KV of tokens [start, end) (e.g. rejected draft tokens)."""
        if end > start:
            self.allocator.free(self.req_slots_np(req, start, end))

    def release(self, req: Req) -> None:
        """A request leaves the running set (finished, aborted or retracted): its KV of
        fill_ids[:kv_len] goes to the prefix cache (or is freed) and its request slot is
        freed. With speculation the cache also learns how much of it has valid draft KV
        (req.draft_valid_len()): a prefix hit beyond that serves the target only."""
        if req.req_pool_idx is None:
            return
        tokens = req.fill_ids[: req.kv_len]
        self.tree_cache.cache_finished_req(
            req.req_pool_idx, tokens, req.last_node, req.draft_valid_len()
        )
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = 0

    def retract_for(self, running: list[Req], need_fn: Callable[[list[Req]], int]) -> list[Req]:
        """Retract requests until the rest fit (need_fn(rest) slots); returns the retracted ones.

        Upstream's order: fewest output tokens first, then longest prompt. The last request is
        never retracted (a single request that cannot fit is an out-of-memory error upstream;
        here the caller finishes it with reason "length").
        """
        order = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        rest = list(running)
        retracted: list[Req] = []
        for req in order:
            if len(rest) <= 1 or self.available_with_eviction() >= need_fn(rest):
                break
            rest.remove(req)
            self.release(req)
            req.reset_for_retract()
            retracted.append(req)
        return retracted

    def check_accounting(self) -> None:
        """With no request holding KV: free slots + cache-held slots == pool size."""
        total = self.allocator.available_size() + self.tree_cache.total_size()
        if total != self.allocator.size:
            raise AssertionError(
                f"KV leak: free {self.allocator.available_size()} + cached "
                f"{self.tree_cache.total_size()} != pool {self.allocator.size}"
            )
