"""Baseline draft-length policies, selectable for comparison with the goodput policy.

- FixedKPolicy: every request drafts min(k, cap_r) every step (k = K is the static server).
- TierPolicy: one draft length for the whole batch from a batch-size tier table, like
  upstream SGLang's batch-size-tiered adaptive speculation: the entry with the largest
  threshold <= batch size applies (below the smallest threshold, the smallest's entry).

Both share the goodput policy's interface: choose(view, time_fn) -> [n] int64.
"""

from __future__ import annotations

import numpy as np

from sglang.srt.speculative.adaptive.policy import BatchView, TimeFn


class FixedKPolicy:
    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, view: BatchView, time_fn: TimeFn) -> np.ndarray:
        """[n] int64: min(k, cap_r)."""
        return np.minimum(view.caps, self.k).astype(np.int64)


class TierPolicy:
    name = "tiers"

    def __init__(self, tiers: dict[int, int]) -> None:
        """tiers: batch-size threshold (>= 1) -> draft length (>= 0)."""
        self.thresholds = sorted(tiers)
        self.lens = [tiers[t] for t in self.thresholds]

    def k_for(self, batch_size: int) -> int:
        k = self.lens[0]
        for t, d in zip(self.thresholds, self.lens, strict=True):
            if batch_size >= t:
                k = d
        return k

    def choose(self, view: BatchView, time_fn: TimeFn) -> np.ndarray:
        """[n] int64: min(tier length for n requests, cap_r)."""
        return np.minimum(view.caps, self.k_for(view.size)).astype(np.int64)
