"""Speculative decoding (EAGLE chains, topk = 1).

Modules:
    verify: acceptance of draft tokens against the target model (greedy and speculative
        sampling), as small per-request references plus batched ragged versions.
"""
