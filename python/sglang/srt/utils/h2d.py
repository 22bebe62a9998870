"""Host-to-device copies of many small int64 vectors in one transfer.

Why: `torch.tensor(list, device="cuda")` and `cpu_tensor.to("cuda")` each copy from pageable
memory and synchronise the stream: the host waits for every kernel queued before it. A step
that builds eight metadata vectors that way waits eight times. Packing them into one pinned
buffer gives one asynchronous copy, ordered on the current stream like the kernels that read
the vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def int64_to_device(
    parts: Sequence[Sequence[int] | np.ndarray | torch.Tensor], device: torch.device | str
) -> list[torch.Tensor]:
    """parts: lists of ints, integer numpy arrays or 1-D integer CPU tensors. Returns one int64
    tensor per part on `device`: views of one buffer (read them on the current stream or after
    it on CUDA), never the callers' memory. Raises ValueError for a part that is not
    one-dimensional.

    The parts are gathered with numpy into one fresh int64 array, so the torch calls are the
    same few whatever the number of parts (on CUDA: pin, one asynchronous copy, one split);
    building one tensor per part and concatenating them cost a torch call per part, tens of
    microseconds each on a loaded host."""
    device = torch.device(device)
    arrays = []
    for p in parts:
        a = np.asarray(p.numpy() if isinstance(p, torch.Tensor) else p, dtype=np.int64)
        if a.ndim != 1:
            raise ValueError(f"int64_to_device: parts must be 1-D, got shape {a.shape}")
        arrays.append(a)
    sizes = [a.size for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64))
    if len(sizes) == 1:
        return [to_device_async(flat, device)]
    return list(to_device_async(flat, device).split(sizes))


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t (a CPU tensor) on `device`: on CUDA through pinned memory, one asynchronous copy
    ordered on the current stream (no wait for the kernels queued before it); else t.to."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
