"""The target's hidden states by KV slot, for speculative decoding's draft model.

An EAGLE draft consumes the target's hidden state of every position it catches up on (EAGLE,
arXiv 2401.15077, section 3; EAGLE-3, arXiv 2503.01840: the concatenation of three layers'
outputs). Every target forward of a speculative server writes the hidden states of its tokens
into the row of their KV slot (ModelRunner.store_hidden, captured inside the CUDA graphs), so
the positions a request decoded without drafting need no bookkeeping of their own: their
hidden states are the rows of their KV slots (req_to_token), read back by the catch-up of the
request's next drafting step. A slot's row is valid as long as its KV is (a freed slot's row
is garbage until the target computes the slot's next token).

Owned like the KV pool: the scheduler owns the slots, the worker's target forwards write the
rows, the draft catch-up reads them.
"""

from __future__ import annotations

import torch


def spec_hidden_width(algorithm: str | None, hidden_size: int) -> int:
    """Width of the hidden state a draft of `algorithm` reads per position: EAGLE3 three
    target layers concatenated (3 * hidden_size), EAGLE the final hidden state
    (hidden_size); 0 without speculation (no pool)."""
    name = (algorithm or "").upper()
    if name == "EAGLE3":
        return 3 * hidden_size
    if name == "EAGLE":
        return hidden_size
    return 0


class HiddenStatePool:
    """buffer: [size + 1, width] `dtype` on `device`; row s = the target hidden state of the
    token whose KV lives in slot s (row 0: the padding slot, written by padded graph rows)."""

    def __init__(self, size: int, width: int, dtype: torch.dtype, device) -> None:
        self.size = size
        self.width = width
        self.buffer = torch.zeros((size + 1, width), dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(width: int, dtype: torch.dtype) -> int:
        return width * torch.finfo(dtype).bits // 8

    def write(self, loc: torch.Tensor, hidden: torch.Tensor) -> None:
        """buffer[loc[i]] = hidden[i]. loc: [n] int64 on the pool's device; hidden: [n,
        width]. Raises ValueError for another width or row count (not silently misplaced)."""
        if hidden.dim() != 2 or hidden.shape[1] != self.width or hidden.shape[0] != loc.numel():
            raise ValueError(
                f"hidden state pool: {tuple(hidden.shape)} rows for {loc.numel()} slots of width "
                f"{self.width}"
            )
        self.buffer.index_copy_(0, loc, hidden.to(self.buffer.dtype))

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        """[n, width] rows of the [n] int64 slots `loc` (a fresh tensor)."""
        return self.buffer.index_select(0, loc)
