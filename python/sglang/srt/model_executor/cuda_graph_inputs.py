"""The CUDA-graph runner's persistent inputs (cuda_graph_runner.py): one packed int64 device
buffer, refreshed from a pinned host buffer with one copy per replay."""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    """A persistent int64 device buffer of `size` entries, refreshed from a pinned host buffer
    with one copy per upload.

    Host staging: two pinned buffers used in turn, each with an event recorded after its
    upload. The host may prepare step N + 1 while step N's upload is still queued behind the
    running step (overlap scheduling queues steps ahead), so a buffer is rewritten only after
    its previous upload ran (`stage`).
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.hosts = [
            torch.zeros(size, dtype=torch.int64, device="cpu", pin_memory=pin) for _ in range(2)
        ]
        self.events: list = [None, None]  # torch.cuda.Event after each buffer's last upload
        self.turn = 0

    def stage(self) -> np.ndarray:
        """The host buffer to fill for the next upload (waits until its last upload ran)."""
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()
        return self.hosts[self.turn].numpy()

    def upload(self) -> None:
        """Copy the staged host buffer to the device buffer (asynchronously on CUDA)."""
        self.dev.copy_(self.hosts[self.turn], non_blocking=True)
        if self.dev.device.type == "cuda":
            event = self.events[self.turn] = self.events[self.turn] or torch.cuda.Event()
            event.record()


class StaticInputs(PinnedStaging):
    """Persistent device inputs, packed in one int64 buffer so one copy refreshes them all.

    Layout (int64): req_pool_indices [B] | seq_lens [B] | extend_seq_lens [B] |
    extend_prefix_lens [B] | extend_start_loc [B] | input_ids [N] | positions [N] |
    out_cache_loc [N], with B = max bs and N = max tokens.
    """

    def __init__(self, max_bs: int, max_tokens: int, device: torch.device) -> None:
        self.B, self.N = max_bs, max_tokens
        super().__init__(5 * max_bs + 3 * max_tokens, device)

    def region(self, t: torch.Tensor, k: int, n: int) -> torch.Tensor:
        """Field k (0..7) of the packed buffer t, first n entries."""
        B, N = self.B, self.N
        off = k * B if k < 5 else 5 * B + (k - 5) * N
        return t[off : off + n]
