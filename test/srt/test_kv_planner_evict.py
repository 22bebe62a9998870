"""KVPlanner.alloc_tokens evicts at least EVICT_MIN_SHARE of the pool per eviction, so that a
full prefix cache does not walk the radix tree on every step."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_radix_cache import Sim  # noqa: E402

from sglang.srt.managers import kv_planner  # noqa: E402
from sglang.srt.managers.kv_planner import KVPlanner  # noqa: E402


def full_cache(size: int) -> tuple[Sim, KVPlanner]:
    """A pool of `size` slots filled with cached 4-token requests (every slot evictable)."""
    sim = Sim(size=size, num_reqs=4, ctx=8)
    for i in range(size // 4):
        sim.cache_request([1000 + i, 1, 2, 3])  # distinct first tokens: one leaf each
    assert sim.alloc.available_size() == 0 and sim.cache.evictable_size() == size
    return sim, KVPlanner(sim.req_pool, sim.alloc, sim.cache)


@pytest.mark.parametrize("share, need, freed", [(1 / 16, 1, 16), (1 / 16, 30, 32), (0.0, 1, 4)])
def test_an_eviction_frees_at_least_its_share_of_the_pool(monkeypatch, share, need, freed):
    """Pool 256, leaves of 4 tokens: one slot needed frees 16 (a sixteenth) at share 1/16, a
    need above the share frees what it needs (rounded up to whole leaves), and share 0 frees
    one leaf, as upstream does. The slots come back in one allocation either way."""
    monkeypatch.setattr(kv_planner, "EVICT_MIN_SHARE", share)
    sim, planner = full_cache(256)
    slots = planner.alloc_tokens(need)
    assert slots is not None and slots.numel() == need
    assert sim.alloc.available_size() == freed - need
    assert sim.cache.evictable_size() == 256 - freed
    sim.alloc.free(slots)


def test_the_share_is_capped_by_what_is_evictable(monkeypatch):
    """When less than the share is evictable, everything evictable goes and the allocation
    still succeeds; when even that is too little, it returns None."""
    monkeypatch.setattr(kv_planner, "EVICT_MIN_SHARE", 1 / 2)
    sim, planner = full_cache(64)
    locked = [sim.start([1000 + i, 1, 2, 3]) for i in range(4)]  # 4 of 16 leaves held
    assert sim.cache.evictable_size() == 48
    slots = planner.alloc_tokens(8)
    assert slots is not None and sim.alloc.available_size() == 32 - 8  # half the pool: 32
    assert planner.alloc_tokens(100) is None  # 24 free + 16 evictable < 100
    assert sim.cache.evictable_size() == 0
    for req in locked:
        sim.finish(req)
