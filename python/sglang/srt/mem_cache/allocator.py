"""Free-list allocator of KV token slots (page size 1). Owned by the scheduler."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size (slot 0 is the padding slot and never allocated).

    The free list is a CPU int64 tensor; alloc/free are O(n) tensor ops, no Python loops.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)  # [num_free]

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need: int) -> torch.Tensor | None:
        """Return `need` free slots ([need] int64, CPU) or None when fewer are free."""
        if need > self.free_slots.numel():
            return None
        out, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots ([n] int64) to the free list."""
        if slots.numel() == 0:
            return
        self.free_slots = torch.cat([self.free_slots, slots.to("cpu", torch.int64)])
