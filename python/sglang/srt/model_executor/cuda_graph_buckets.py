"""Which CUDA graphs exist and which one a step replays: the batch-size buckets
(--cuda-graph-bs / --cuda-graph-max-bs), the single-request prefill token buckets
(--cuda-graph-prefill-max-tokens) and the key of one captured graph. The replay itself is
cuda_graph_runner.py's."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256]
DEFAULT_CUDA_GRAPH_MAX_BS = 256
SMALLEST_PREFILL_BUCKET = 16


def prefill_token_buckets(max_tokens: int, above: int, limit: int | None = None) -> list[int]:
    """Token buckets of the single-request prefill graphs: powers of two from
    SMALLEST_PREFILL_BUCKET up to the first one >= max_tokens (0: none), keeping those above
    `above` (the decode / verify buckets of bs 1 already cover 1..above tokens) and, given a
    limit (the model's context length), those up to it: no prefill computes more tokens, and
    the capture's dummy batch of a longer bucket (positions 0..T - 1 of one request) would
    index the RoPE cache and the request's req_to_token row out of range."""
    if max_tokens <= 0:
        return []
    out, t = [], SMALLEST_PREFILL_BUCKET
    while limit is None or t <= limit:
        if t > above:
            out.append(t)
        if t >= max_tokens:
            break
        t *= 2
    return out


def graph_batch_sizes(
    cuda_graph_bs: list[int] | None, cuda_graph_max_bs: int | None, max_running_requests: int
) -> list[int]:
    """Sorted bs buckets: --cuda-graph-bs (or the default list) cut at --cuda-graph-max-bs
    (default: the largest of --cuda-graph-bs, else 256) and at --max-running-requests; with the
    default list the cut itself is a bucket. Never empty."""
    cap = cuda_graph_max_bs or (max(cuda_graph_bs) if cuda_graph_bs else DEFAULT_CUDA_GRAPH_MAX_BS)
    max_bs = min(cap, max_running_requests)
    sizes = sorted({b for b in (cuda_graph_bs or DEFAULT_CUDA_GRAPH_BS) if b <= max_bs})
    if not sizes or (cuda_graph_bs is None and sizes[-1] < max_bs):
        sizes.append(max_bs)
    return sizes


@dataclass(frozen=True)
class GraphKey:
    bs: int  # requests in the graph (real + pad)
    num_tokens: int  # token rows in the graph (= logits rows)

    @property
    def max_extend_len(self) -> int:
        return -(-self.num_tokens // self.bs)
