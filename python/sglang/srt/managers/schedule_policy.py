"""Which waiting requests enter the next prefill step, and how many of their tokens.

SchedulePolicy orders the waiting queue (fcfs, or lpm: longest cached prefix first, upstream's
policies); PrefillAdder admits requests under the step's token budget, the KV pool and the
running-request limit, reserving room for the decode tokens that running requests will need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

# Upstream's reservation for future decode tokens: each running request is expected to need
# min(remaining max_new_tokens, CLIP) * new_token_ratio more slots.
NEW_TOKEN_CLIP = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.14
NEW_TOKEN_RATIO_DECAY = 0.001


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: BasePrefixCache) -> None:
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy must be fcfs or lpm, got {policy!r}")
        self.policy = policy
        self.tree_cache = tree_cache

    def order(self, waiting: list[Req]) -> list[Req]:
        if self.policy == "fcfs" or len(waiting) <= 1:
            return waiting
        lens = {
            id(r): len(self.tree_cache.match_prefix(r.fill_ids).device_indices) for r in waiting
        }
        return sorted(waiting, key=lambda r: -lens[id(r)])


def remaining_new_tokens(req: Req) -> int:
    return max(0, req.sampling_params.max_new_tokens - len(req.output_ids))


@dataclass
class PrefillAdder:
    """Token and memory budget of one prefill step."""

    token_budget: int  # prompt tokens this step may compute (chunked prefill size)
    available_kv: int  # free + evictable KV slots
    running_reserve: int  # slots reserved for decode tokens of running requests
    free_req_slots: int  # request slots still admissible
    new_token_ratio: float
    chunking: bool = True
    admitted: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)

    def room(self) -> int:
        return self.available_kv - self.running_reserve

    def try_add(self, req: Req, prefix_len: int) -> int:
        """Admit `req` with `prefix_len` cached tokens; returns how many tokens it computes this
        step (0 = not admitted, stop adding). Less than the remainder means a chunk."""
        if self.free_req_slots <= 0 and req.req_pool_idx is None:
            return 0
        remaining = req.seqlen - prefix_len
        extend = min(remaining, self.token_budget) if self.chunking else remaining
        if extend <= 0 or (not self.chunking and self.admitted and extend > self.token_budget):
            return 0
        reserve = int(min(remaining_new_tokens(req), NEW_TOKEN_CLIP) * self.new_token_ratio)
        need = extend + (reserve if extend == remaining else 0)
        if need > self.room():
            # A chunk of what fits is still progress when nothing else is running.
            extend = min(extend, self.room())
            if not self.chunking or extend <= 0 or self.admitted or self.running_reserve > 0:
                return 0
            reserve = 0
        self.admitted.append(req)
        self.extend_lens.append(extend)
        self.token_budget -= extend
        self.available_kv -= extend
        if extend == remaining:
            self.running_reserve += reserve
        if req.req_pool_idx is None:
            self.free_req_slots -= 1
        return extend
