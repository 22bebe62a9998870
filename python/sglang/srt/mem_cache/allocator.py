"""Free-list allocator of KV token slots (page size 1). Owned by the scheduler."""

from __future__ import annotations

import numpy as np
import torch


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size (slot 0 is the padding slot and never allocated).

    The free list is a stack in a preallocated CPU int64 tensor: alloc takes the top `need`
    slots, free pushes slots back, each O(n) in the slots moved (not in the pool size: freeing a
    finished request no longer copies the whole free list).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def clear(self) -> None:
        # [size], top of the stack at the end; a fresh pool hands out 1, 2, 3, ... in order
        self._stack = torch.arange(self.size, 0, -1, dtype=torch.int64, device="cpu")
        # its numpy view: alloc and free move slots through it, without torch calls (a
        # drafting step frees each request's rejected slots)
        self._stack_np = self._stack.numpy()
        self._num_free = self.size  # _stack[:_num_free] are the free slots

    @property
    def free_slots(self) -> torch.Tensor:
        """The free slots ([num_free] int64, CPU; a view: copy it before allocating)."""
        return self._stack[: self._num_free]

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, need: int) -> torch.Tensor | None:
        """Return `need` free slots ([need] int64, CPU, a fresh tensor) or None when fewer are
        free."""
        if need > self._num_free:
            return None
        self._num_free -= need
        top = self._stack_np[self._num_free : self._num_free + need]
        return torch.from_numpy(top[::-1].copy())

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        """Return slots ([n] integers, a tensor or a numpy array) to the free list. Raises
        ValueError when more slots come back than the pool holds (a double free)."""
        if isinstance(slots, np.ndarray):
            host = slots
        else:
            host = (slots if slots.device.type == "cpu" else slots.cpu()).numpy()
        n = host.size
        if n == 0:
            return
        if self._num_free + n > self.size:
            raise ValueError(f"freeing {n} slots overflows the pool of {self.size} (double free)")
        # pushed reversed, so freeing then allocating the same count returns the same order
        self._stack_np[self._num_free : self._num_free + n] = host.reshape(-1)[::-1]
        self._num_free += n
