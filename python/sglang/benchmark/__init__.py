"""Helpers of `python -m sglang.bench_serving`: prompt datasets and request backends."""
