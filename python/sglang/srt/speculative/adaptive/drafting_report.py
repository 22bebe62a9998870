"""DraftingReport: where in a run the adaptive server drafted, and what the step-time model
expected those drafting steps to cost against what they measured (server info key
`spec_drafting_by_bs`)."""

from __future__ import annotations

from collections.abc import Sequence


def bs_bucket_name(key: int) -> str:
    """Name of the batch-size bucket key = bs.bit_length(): "1", "2-3", "4-7", ... (the same in
    spec_drafting_by_bs and spec_guard_blocked_bs)."""
    lo, hi = 1 << (key - 1), (1 << key) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


class DraftingReport:
    """Drafting steps counted per batch-size bucket (bs.bit_length(): '1', '2-3', '4-7', ...)."""

    def __init__(self) -> None:
        # bucket -> [steps, request-steps, committed tokens, predicted s, measured s]
        self._by_bs: dict[int, list[float]] = {}

    def record(
        self,
        bs: int,
        draft_lens: Sequence[int],
        accepted: Sequence[int],
        predicted_s: float,
        measured_s: float,
    ) -> None:
        """Count one drafting step of bs requests (draft_lens, accepted: [bs] each) in its
        bucket: predicted_s is the model's time for it, measured_s what it cost (seconds)."""
        row = self._by_bs.setdefault(bs.bit_length(), [0, 0, 0, 0.0, 0.0])
        row[0] += 1
        row[1] += sum(1 for d in draft_lens if d)
        row[2] += bs + int(sum(accepted))
        row[3] += predicted_s
        row[4] += measured_s

    def report(self) -> dict[str, dict[str, float]]:
        """Drafting steps so far by bucket: steps, request_steps (requests with d > 0), tokens
        (committed by those steps), predicted_s and measured_s (sums over the steps; seconds)."""
        out = {}
        for key in sorted(self._by_bs):
            steps, reqs, tokens, pred, meas = self._by_bs[key]
            out[bs_bucket_name(key)] = {
                "steps": steps,
                "request_steps": reqs,
                "tokens": tokens,
                "predicted_s": round(pred, 6),
                "measured_s": round(meas, 6),
            }
        return out
