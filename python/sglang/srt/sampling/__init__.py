"""Sampling: per-request parameters, batched sampling state, penalties and seeded randomness."""
