"""The CUDA-graph runner's persistent inputs (cuda_graph_runner.py): one packed int64 device
buffer, refreshed from a pinned host buffer with one copy per replay, and how one (padded) step
is written into it (StaticInputs.write_ragged / write_decode)."""

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

    def write_ragged(
        self,
        b: int,
        n: int,
        req_pool_indices: list[int],
        seq_lens: list[int],
        extend_lens: list[int],
        input_ids: np.ndarray | None,
        num_ids: int,
        out_cache_loc: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stage and upload one step of bs = len(seq_lens) requests, padded to a bucket of b
        requests and n tokens: request i computes extend_lens[i] >= 1 tokens ending at
        seq_lens[i]; each pad request computes one token at position 0 of KV slot 0 (req_to_token
        row 0). input_ids: [num_ids] int64 ids, or None when the caller copies ids already on the
        device into the input_ids field after this upload; out_cache_loc: [num_ids] int64.
        Returns the padded host seq_lens, extend_seq_lens and extend_prefix_lens ([b] int64)."""
        h = self.stage()
        pad = b - len(seq_lens)
        seq = np.array(list(seq_lens) + [1] * pad, dtype=np.int64)
        ext = np.array(list(extend_lens) + [1] * pad, dtype=np.int64)
        pre = seq - ext
        starts = np.cumsum(ext) - ext
        positions = np.arange(num_ids + pad, dtype=np.int64) - np.repeat(starts - pre, ext)

        def put(k: int, values, count: int) -> None:
            region = self.region(h, k, count)
            region[: len(values)] = values
            region[len(values) :] = 0

        put(0, list(req_pool_indices) + [0] * pad, b)
        put(1, seq, b)
        put(2, ext, b)
        put(3, pre, b)
        put(4, starts, b)
        put(5, input_ids if input_ids is not None else [], n)
        put(6, positions, n)
        put(7, out_cache_loc, n)
        # One transfer of the whole packed buffer (max_bs * 5 + max_tokens * 3 int64: small).
        self.upload()
        return seq, ext, pre

    def write_decode(
        self,
        b: int,
        req_pool_indices: list[int],
        seq_lens: list[int],
        input_ids: np.ndarray | None,
        out_cache_loc: np.ndarray,
        arange: np.ndarray,
    ) -> np.ndarray:
        """write_ragged for one token per request, as a few slice assignments (the common
        decode step): the same buffer contents. arange: [>= b] int64 0, 1, ... (the request
        starts). Returns the padded host seq_lens [b] int64."""
        h = self.stage()
        B, N, bs = self.B, self.N, len(seq_lens)
        seq = np.ones(b, dtype=np.int64)
        seq[:bs] = seq_lens
        pre = seq - 1
        h[0:bs] = req_pool_indices
        h[bs:b] = 0
        h[B : B + b] = seq
        h[2 * B : 2 * B + b] = 1
        h[3 * B : 3 * B + b] = pre
        h[4 * B : 4 * B + b] = arange[:b]
        ids = 5 * B
        if input_ids is not None:
            h[ids : ids + bs] = input_ids
        h[ids + bs : ids + b] = 0
        h[ids + N : ids + N + b] = pre  # positions
        loc = ids + 2 * N
        h[loc : loc + bs] = out_cache_loc
        h[loc + bs : loc + b] = 0
        self.upload()
        return seq
