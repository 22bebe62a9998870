"""Which CUDA graphs exist and which one a step replays: the batch-size buckets
(--cuda-graph-bs / --cuda-graph-max-bs), the prefill token buckets
(--cuda-graph-prefill-max-tokens, --cuda-graph-prefill-max-bs), the key of one captured graph
and GraphBuckets, the layout of one runner's graphs and the choice of a step's graph. The
capture and replay are cuda_graph_runner.py's."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)

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


class GraphBuckets:
    """The graphs of one CudaGraphRunner (see its module docstring) and which one a step
    replays. Args: batch_sizes (bs buckets, ascending), capture_hidden_mode and max_extend_len
    (the runner's), prefill_max_tokens (P > 0: prefill buckets, when batch_sizes starts at 1),
    prefill_max_bs (the largest bs bucket with prefill buckets), full_token_buckets_only (one
    decode / verify bucket per bs bucket, of b * max_extend_len tokens), chunk_size
    (--chunked-prefill-size, None when prompts are not chunked: no prefill bucket beyond the
    first that holds a chunk) and context_len (no prefill bucket beyond it per request).

    Sets batch_sizes, max_bs, token_buckets ({b: ascending token counts}: decode / verify,
    then prefill), prefill_token_buckets ({b: prefill token counts} for b up to
    prefill_max_bs), prefill_buckets (bs 1's), max_tokens and keys (every GraphKey)."""

    def __init__(
        self,
        batch_sizes: list[int],
        capture_hidden_mode: CaptureHiddenMode,
        max_extend_len: int,
        prefill_max_tokens: int = 0,
        prefill_max_bs: int = 1,
        full_token_buckets_only: bool = False,
        chunk_size: int | None = None,
        context_len: int | None = None,
    ) -> None:
        self.capture_hidden_mode = capture_hidden_mode
        self.max_extend_len = max_extend_len
        self.batch_sizes = batch_sizes
        self.max_bs = batch_sizes[-1]
        # token buckets per bs bucket, ascending: decode / verify, then bs 1's prefill buckets
        self.token_buckets = {b: [b * (1 + k) for k in range(max_extend_len)] for b in batch_sizes}
        if full_token_buckets_only:
            self.token_buckets = {b: [b * max_extend_len] for b in batch_sizes}
        self.prefill_buckets = []  # bs 1's prefill token buckets
        # prefill token buckets per bs bucket (bs 1, then up to prefill_max_bs)
        self.prefill_token_buckets: dict[int, list[int]] = {}
        if prefill_max_tokens > 0 and batch_sizes[0] == 1:
            longest = min(prefill_max_tokens, chunk_size or prefill_max_tokens)
            for b in batch_sizes:
                if b > max(prefill_max_bs, 1):
                    break
                # limit * b: the capture's dummy batch splits the tokens over the b requests
                limit = None if context_len is None else context_len * b
                self.prefill_token_buckets[b] = prefill_token_buckets(
                    longest, b * max_extend_len, limit=limit
                )
            self.prefill_buckets = self.prefill_token_buckets[1]
        elif prefill_max_tokens > 0:
            logger.warning(
                "--cuda-graph-prefill-max-tokens %d: no prefill graphs, since the CUDA-graph "
                "batch sizes %s do not include 1",
                prefill_max_tokens,
                batch_sizes,
            )
        for b, ns in self.prefill_token_buckets.items():
            self.token_buckets[b] += ns
        longest_prefill = [n for ns in self.prefill_token_buckets.values() for n in ns]
        self.max_tokens = max(self.max_bs * max_extend_len, *longest_prefill, 0)
        self.keys = [GraphKey(b, n) for b, ns in self.token_buckets.items() for n in ns]

    def can_run(self, mwb: ModelWorkerBatch, capture_hidden_mode: CaptureHiddenMode) -> bool:
        """True when mwb fits a captured graph: a decode/verify step (every computed token is
        a logits row, as in a prefill of one token per request) with the captured hidden-state
        mode (or FULL when LAST was captured: the same rows), or a prefill that a prefill bucket
        holds (hidden states: the captured mode, or FULL when LAST was captured, since prefill
        buckets then capture every row): one request, or several up to the prefill bs limit
        that all sample (one logits row each) with NULL or FULL hidden states; never with
        input logprobs."""
        return self.key_for(mwb, capture_hidden_mode) is not None

    def key_for(
        self, mwb: ModelWorkerBatch, capture_hidden_mode: CaptureHiddenMode
    ) -> GraphKey | None:
        """The GraphKey mwb replays (see can_run), or None."""
        if mwb.return_logprob and any(mwb.input_logprob_targets):
            return None
        ext = mwb.extend_seq_lens
        if mwb.num_logit_rows == ext:
            # Every computed token is a logits row: LAST's hidden rows are FULL's. (A prefill
            # of one token per request asks FULL: a fully cached prompt recomputes its last
            # token, and a speculative server ran it eagerly, ~30 ms of launches on the H100
            # host, about once per point of a c = 2 run; thirty-ninth session.)
            if capture_hidden_mode not in self.all_rows_modes() or not self.fits(ext):
                return None
            return self.pick(len(ext), sum(ext))
        bs = mwb.batch_size
        if not self.prefill_buckets or bs > max(self.prefill_token_buckets) or bs == 0:
            return None
        if capture_hidden_mode not in self.prefill_modes():
            return None
        if bs == 1:  # bs-1 buckets only: one lm_head row, as the eager prefill computes
            key = self.pick(1, ext[0]) if self.fits(ext) else None
            return key if key is not None and key.bs == 1 else None
        if capture_hidden_mode == CaptureHiddenMode.LAST or any(n != 1 for n in mwb.num_logit_rows):
            return None  # the logits / hidden rows would need a gather
        key = self.pick_prefill(bs, sum(ext))
        return key if key is not None and max(ext) <= self.longest_request(key) else None

    def is_prefill_key(self, key: GraphKey) -> bool:
        """A prefill bucket (more tokens than a verify step of key.bs requests computes)."""
        return key.num_tokens > key.bs * self.max_extend_len

    def all_rows_modes(self) -> tuple[CaptureHiddenMode, ...]:
        """Hidden-state modes a step whose every token is a logits row may ask of the graphs:
        the captured mode, and FULL when LAST was captured (the same rows)."""
        if self.capture_hidden_mode == CaptureHiddenMode.LAST:
            return (CaptureHiddenMode.LAST, CaptureHiddenMode.FULL)
        return (self.capture_hidden_mode,)

    def prefill_modes(self) -> tuple[CaptureHiddenMode, ...]:
        if self.capture_hidden_mode == CaptureHiddenMode.LAST:
            return (CaptureHiddenMode.LAST, CaptureHiddenMode.FULL)
        return (self.capture_hidden_mode,)

    def fits(self, extend_lens: list[int]) -> bool:
        """Whether requests computing these numbers of tokens (each >= 1) fit a captured graph:
        at least one and at most max_bs requests, a bucket holding them all, and none longer
        than that bucket's longest_request."""
        bs = len(extend_lens)
        if not 0 < bs <= self.max_bs:
            return False
        key = self.pick(bs, sum(extend_lens))
        return key is not None and max(extend_lens) <= self.longest_request(key)

    def longest_request(self, key: GraphKey) -> int:
        """Most tokens one request can compute in key's graph: max_extend_len, or fewer when
        the other key.bs - 1 requests (one token each at least) leave less; a prefill bucket's
        token count less one token for each other request. This, not the bucket's tokens per
        request (key.max_extend_len), bounds what the attention backend must cover: a replay
        of 2 requests with 41 + 1 tokens fits bucket (2, 42), whose average is 21 (the Triton
        extend kernel sizes its grid of query blocks from it)."""
        if self.is_prefill_key(key):
            return key.num_tokens - (key.bs - 1)
        return min(self.max_extend_len, key.num_tokens - (key.bs - 1))

    def pick(self, bs: int, num_tokens: int) -> GraphKey | None:
        """The smallest bucket holding bs requests and num_tokens tokens plus one token per
        pad request."""
        i = bisect.bisect_left(self.batch_sizes, bs)
        for b in self.batch_sizes[i:]:
            need = num_tokens + (b - bs)
            buckets = self.token_buckets[b]
            j = bisect.bisect_left(buckets, need)
            if j < len(buckets):
                return GraphKey(b, buckets[j])
        return None

    def pick_prefill(self, bs: int, num_tokens: int) -> GraphKey | None:
        """The smallest prefill bucket (of a bs bucket >= bs with prefill buckets) holding
        num_tokens tokens plus one per pad request; None when none does. Only prefill buckets:
        a verify bucket would compute every row's logits, and a prefill needs each request's
        last row only."""
        for b in self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs) :]:
            buckets = self.prefill_token_buckets.get(b)
            if buckets is None:
                return None
            j = bisect.bisect_left(buckets, num_tokens + (b - bs))
            if j < len(buckets):
                return GraphKey(b, buckets[j])
        return None
