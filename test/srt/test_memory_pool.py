"""ReqToTokenPool.read and the KV slot allocator, which move slots through numpy views of their
CPU tables (no torch calls per request in a drafting step's build and commit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


def test_read_returns_a_fresh_int64_copy_of_the_row():
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    pool.write(1, 2, torch.tensor([11, 12, 13], dtype=torch.int64))
    got = pool.read(1, 1, 5)
    assert got.dtype == torch.int64 and got.tolist() == [0, 11, 12, 13]
    got[1] = -5  # a copy: the table is unchanged
    assert pool.req_to_token[1, 2].item() == 11
    assert pool.read(2, 0, 0).tolist() == []
    assert pool.read(1, 0, 8).tolist() == [0, 0, 11, 12, 13, 0, 0, 0]
    arr = pool.read_np(1, 2, 4)  # the numpy form: int64, a copy
    assert arr.dtype == np.int64 and arr.tolist() == [11, 12]
    arr[0] = 0
    assert pool.read_np(1, 2, 3).tolist() == [11]
    for slot, start, end in [(1, 6, 9), (3, 0, 1), (-1, 0, 1), (0, 3, 2)]:
        with pytest.raises(IndexError, match="outside the table"):
            pool.read(slot, start, end)


def test_allocator_stack_order_and_double_free():
    a = TokenToKVPoolAllocator(10)
    first = a.alloc(4)
    assert first.dtype == torch.int64 and first.tolist() == [1, 2, 3, 4]
    first[0] = 99  # a fresh tensor: the free list is unchanged
    a.free(torch.tensor([3, 4, 1, 2], dtype=torch.int32))  # other dtypes are accepted
    assert a.available_size() == 10
    held = a.alloc(4)
    assert held.tolist() == [3, 4, 1, 2]  # freeing then allocating keeps the order
    a.free(torch.stack([held, torch.zeros_like(held)], dim=1).reshape(-1)[::2])  # strided
    assert a.alloc(2).tolist() == [3, 4]
    a.free(np.array([4, 3], dtype=np.int32))  # numpy arrays too
    assert a.alloc(2).tolist() == [4, 3]
    assert a.alloc(100) is None
    with pytest.raises(ValueError, match="double free"):
        a.free(torch.arange(1, 11))


def test_req_to_token_mirror_stays_on_cpu_under_another_default_device():
    """The scheduler's mirror and the KV allocator's stack are CPU tensors (numpy views)
    whatever the default device; the fused-kernel tests build pools inside
    `with torch.device("cuda")`. The meta device stands
    in for CUDA here: the pool on meta, its mirror still on the CPU."""
    with torch.device("meta"):
        pool = ReqToTokenPool(4, 8, "meta")
        allocator = TokenToKVPoolAllocator(16)  # its free stack is a CPU tensor (numpy view)
    assert allocator.free_slots.device.type == "cpu"
    assert allocator.alloc(3).tolist() == [1, 2, 3]
    assert pool.req_to_token.device.type == "meta"
    assert pool.req_to_token_cpu.device.type == "cpu"
    pool.write(0, 0, torch.tensor([5, 6, 7], dtype=torch.int32))
    assert pool.req_to_token_cpu[0, :3].tolist() == [5, 6, 7]
