"""int64_to_device: several small int64 vectors in one host-to-device copy (on CUDA a pinned
buffer and one asynchronous copy; on the CPU plain tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang.srt.utils.h2d import int64_to_device, to_device_async


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_int64_to_device_packs_parts_in_order(dev):
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA only")
    src = torch.tensor([9, 4], dtype=torch.int64)
    parts = [
        [3, 1, 2],
        torch.tensor([7, 8], dtype=torch.int32),
        [],
        np.array([5]),
        src[::2],
        torch.arange(6).view(2, 3)[:, 1],
    ]
    out = int64_to_device(parts, dev)
    assert [t.tolist() for t in out] == [[3, 1, 2], [7, 8], [], [5], [9], [1, 4]]
    assert all(t.dtype == torch.int64 and t.device.type == dev for t in out)
    (one,) = int64_to_device([src], dev)
    src[0] = -1  # the results never alias the caller's memory
    assert one.tolist() == [9, 4] and out[4].tolist() == [9]
    with pytest.raises(ValueError, match="1-D"):
        int64_to_device([torch.zeros(2, 2)], dev)


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_to_device_async_copies_values(dev):
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA only")
    t = torch.tensor([[1.5, -2.0], [3.0, 0.25]])
    out = to_device_async(t, dev)
    assert out.device.type == dev and out.dtype == t.dtype
    assert torch.equal(out.cpu(), t)
