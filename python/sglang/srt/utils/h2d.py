"""Host-to-device copies of many small int64 vectors in one transfer.

Why: `torch.tensor(list, device="cuda")` and `cpu_tensor.to("cuda")` each copy from pageable
memory and synchronise the stream: the host waits for every kernel queued before it. A step
that builds eight metadata vectors that way waits eight times. Packing them into one pinned
buffer gives one asynchronous copy, ordered on the current stream like the kernels that read
the vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def int64_to_device(
    parts: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str
) -> list[torch.Tensor]:
    """parts: lists of ints or 1-D integer CPU tensors. Returns one int64 tensor per part on
    `device` (views of one buffer on CUDA; read them on the current stream or after it).
    Raises ValueError for a part that is not one-dimensional."""
    device = torch.device(device)
    host = []
    for p in parts:
        t = torch.as_tensor(p, dtype=torch.int64)
        if t.dim() != 1:
            raise ValueError(f"int64_to_device: parts must be 1-D, got shape {tuple(t.shape)}")
        host.append(t)
    if device.type != "cuda":
        return [t.to(device) for t in host]
    if len(host) == 1 and not isinstance(parts[0], torch.Tensor):
        # nothing to pack or split; a list or array gives a fresh unpinned tensor, which
        # pin_memory copies (a pinned caller tensor would be copied from asynchronously
        # in place, so tensors take the packing path, which copies them first)
        return [to_device_async(host[0], device)]
    sizes = [int(t.numel()) for t in host]
    flat = torch.cat(host) if host else torch.empty(0, dtype=torch.int64)
    return list(to_device_async(flat, device).split(sizes))


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t (a CPU tensor) on `device`: on CUDA through pinned memory, one asynchronous copy
    ordered on the current stream (no wait for the kernels queued before it); else t.to."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
