"""Memory pools: request slots -> token slots (ReqToTokenPool) and per-layer KV (MHATokenToKVPool).

Both are owned by the scheduler: only the scheduler allocates, frees and writes req_to_token.
Slot 0 of the KV pool is a padding slot that is never handed out, so padded tokens (CUDA graphs)
can write there harmlessly.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang.srt.layers.triton_kernels import use_triton_kernels
from sglang.srt.utils.h2d import int64_to_device


class ReqToTokenPool:
    """Maps a request slot to the KV slots of its tokens.

    req_to_token: [size, max_context_len] int32 on the model device; row r, column j = KV slot
    of token j of the request holding slot r (read by attention kernels). req_to_token_cpu is a
    CPU mirror the scheduler reads without device synchronisation (the same tensor on CPU).
    Written by the scheduler only, through write().
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        on_cpu = torch.device(device).type == "cpu"
        self.req_to_token_cpu = (
            self.req_to_token
            if on_cpu
            else torch.zeros((size, max_context_len), dtype=torch.int32, device="cpu")
        )
        self._cpu_flat = self.req_to_token_cpu.numpy().reshape(-1)  # [size * width] int32 view
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need: int = 1) -> list[int] | None:
        """Take `need` request slots; None when not enough are free."""
        if need > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return taken

    def free(self, slot: int) -> None:
        assert slot not in self.free_slots, f"double free of request slot {slot}"
        self.free_slots.append(slot)

    def write(self, slot: int, start: int, locs: torch.Tensor) -> None:
        """req_to_token[slot, start:start+len(locs)] = locs (device table and CPU mirror)."""
        end = start + locs.numel()
        self.req_to_token[slot, start:end] = locs.to(self.req_to_token.device, torch.int32)
        if self.req_to_token_cpu is not self.req_to_token:
            self.req_to_token_cpu[slot, start:end] = locs.to("cpu", torch.int32)

    def write_many(
        self, slots: list[int], starts: list[int], lens: list[int], locs: torch.Tensor
    ) -> None:
        """For each i: req_to_token[slots[i], starts[i]:starts[i]+lens[i]] = the i-th run of
        locs ([sum(lens)] int64 CPU, runs in order). Raises IndexError for a run outside a
        row (as indexing the 2-D table would). The positions are computed with numpy as
        flat indices into the table; the CPU mirror is written through its numpy view (no
        torch call) and the device table with one asynchronous (pinned) copy of [indices |
        values] and one indexed write: about 7 torch calls per step instead of 17 (every
        decode step makes one; on the H200 host each small call costs tens of microseconds of
        a host-bound step)."""
        total = int(locs.numel())
        if total == 0:
            return
        width = self.max_context_len
        first = np.asarray(starts, dtype=np.int64)
        if total == len(slots):  # one token per request (decode)
            rows, cols, last = np.asarray(slots, dtype=np.int64), first, first
        else:
            n = np.asarray(lens, dtype=np.int64)
            rows = np.repeat(np.asarray(slots, dtype=np.int64), n)
            cols = np.arange(total, dtype=np.int64) + np.repeat(first - (np.cumsum(n) - n), n)
            last = first + n - 1
        if int(last.max()) >= width or int(first.min()) < 0:  # a flat index would wrap a row
            raise IndexError(f"req_to_token write outside rows of {width} tokens: {starts}")
        flat = rows * width + cols
        host = locs if locs.device.type == "cpu" else locs.cpu()
        vals = host.numpy().reshape(-1).astype(np.int64, copy=False)
        self._cpu_flat[flat] = vals  # the CPU mirror (on a CPU device: the table itself)
        if self.req_to_token_cpu is not self.req_to_token:
            (packed,) = int64_to_device([np.concatenate([flat, vals])], self.req_to_token.device)
            self.req_to_token.view(-1)[packed[:total]] = packed[total:].to(torch.int32)

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """KV slots of tokens [start, end) of the request in `slot`: [end - start] int64, CPU
        (a fresh tensor, read_np's array). Raises IndexError outside the table."""
        return torch.from_numpy(self.read_np(slot, start, end))

    def read_np(self, slot: int, start: int, end: int) -> np.ndarray:
        """read as a fresh [end - start] int64 numpy array, through the CPU mirror's numpy view
        (no torch call: a drafting step reads every drafting request's slots twice)."""
        w = self.max_context_len
        if not (0 <= slot < self.size and 0 <= start <= end <= w):
            raise IndexError(f"req_to_token read [{start}, {end}) of slot {slot} outside the table")
        return self._cpu_flat[slot * w + start : slot * w + end].astype(np.int64)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """Per-layer K and V buffers indexed by token slot (page size 1).

    k_buffer[layer], v_buffer[layer]: [size + 1, num_kv_heads, head_dim] in `dtype`;
    slot 0 is padding.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        shape = (size + 1, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]

    @staticmethod
    def bytes_per_token(dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int) -> int:
        return 2 * head_num * head_dim * layer_num * torch.finfo(dtype).bits // 8

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,  # [num_tokens] int64
        k: torch.Tensor,  # [num_tokens, head_num, head_dim]
        v: torch.Tensor,  # [num_tokens, head_num, head_dim]
    ) -> None:
        """k_buffer[layer_id][loc] = k, v_buffer[layer_id][loc] = v (cast to the pool dtype).
        On CUDA with the Triton kernels enabled, one kernel writes both (kv_store.py)."""
        if use_triton_kernels(k):
            from sglang.srt.layers.triton_kernels.kv_store import store_kv

            store_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k, v)
            return
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)
