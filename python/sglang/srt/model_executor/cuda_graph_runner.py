"""CUDA graphs for steps in which every computed token is a logits row: decode (one token per
request) and hybrid speculative verify (1 + d_i tokens for request i, d_i free per request);
and, with --cuda-graph-prefill-max-tokens P, prefills of up to P tokens (the graph computes
the logits of each prompt's last token only, as an eager prefill does, and the hidden states
of every row when the runner captures any): of one request, or of several that all sample in
the bs buckets up to --cuda-graph-prefill-max-bs (default 8). Which graphs exist and which one
a step replays is GraphBuckets' (cuda_graph_buckets.py), which this runner extends.

A graph is captured per (bs bucket, token bucket): bs bucket b from --cuda-graph-bs, token
buckets b * (1 + k) for k = 0..max_extend_len - 1, plus, for each b up to the prefill bs
limit, the prefill buckets (prefill_token_buckets: powers of two from 16 up to P, above
b * max_extend_len). A decode / verify step of bs requests and T tokens replays the smallest
b >= bs whose token bucket holds T + (b - bs) tokens; a prefill of several requests the
smallest such prefill bucket (pick_prefill). Padding
(upstream's convention): pad requests compute one token each, at position 0 of request-pool
row 0 with seq length 1, and write their K/V to the KV pool's padding slot 0; token rows
beyond the last request are unassigned (attention skips them). Every op of the model is
row-wise except attention, which reads only a request's own keys, so padding never changes the
real rows' outputs.

The runner owns all static inputs: one packed int64 device buffer refreshed with a single
host-to-device copy per replay. Outputs are copied out of the graph's static buffers, so
results survive the next replay.
"""

from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import ModelWorkerBatch
from sglang.srt.model_executor.cuda_graph_buckets import GraphBuckets, GraphKey
from sglang.srt.model_executor.cuda_graph_inputs import StaticInputs
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)

logger = logging.getLogger(__name__)


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """t as int64 (t itself when it already is: no call)."""
    return t if t.dtype == torch.int64 else t.to(torch.int64)


class CudaGraphRunner(GraphBuckets):
    """Captures and replays the target model's forward for decode / verify steps.

    Args: model_runner (its model, pools and attention backend; the backend must set
    supports_cuda_graph), capture_hidden_mode (NULL for plain serving; LAST when speculating:
    the hidden states of every logits row come back), max_extend_len (1 without speculation,
    K + 1 with it), batch_sizes (bs buckets), use_graphs (False: run the padded static batch
    eagerly — the same padding path on CPU, used by the tests), prefill_max_tokens (P > 0:
    also graphs for one request computing up to P tokens, when batch_sizes starts at 1; no
    bucket beyond the model's context length), backend (the attention backend the graphs
    capture; default: the model runner's), full_token_buckets_only (one graph per bs bucket b,
    of b * max_extend_len tokens, instead of one per token bucket), verify_backend (an
    attention backend for the verify buckets, more tokens than requests, of bs up to
    verify_backend_max_bs, and for the decode buckets, one token per request, of bs up to
    decode_backend_max_bs; other decode and prefill buckets keep `backend`), prefill_max_bs
    (the largest bs bucket with prefill buckets; 1: single-request prefills only).
    """

    # The forward mode of a key with more tokens than requests that is no prefill bucket: the
    # target's verify steps. The draft's runners capture catch-up draft extends instead.
    # (Attention backends may choose kernels by it: TritonAttnBackend's verify-as-decode.)
    multi_token_mode = ForwardMode.TARGET_VERIFY

    def __init__(
        self,
        model_runner,
        capture_hidden_mode: CaptureHiddenMode,
        max_extend_len: int,
        batch_sizes: list[int],
        use_graphs: bool = True,
        prefill_max_tokens: int = 0,
        backend=None,
        full_token_buckets_only: bool = False,
        verify_backend=None,
        verify_backend_max_bs: int = 0,
        decode_backend_max_bs: int = 0,
        prefill_max_bs: int = 1,
    ) -> None:
        self.runner = model_runner
        self.model = model_runner.model
        self.backend = backend if backend is not None else model_runner.attn_backend
        self.verify_backend = verify_backend
        self.verify_backend_max_bs = verify_backend_max_bs if verify_backend is not None else 0
        self.decode_backend_max_bs = decode_backend_max_bs if verify_backend is not None else 0
        self.device = model_runner.device
        self.use_graphs = use_graphs
        chunk = context_len = None
        if prefill_max_tokens > 0:  # (a draft runner has neither: it has no prefill buckets)
            chunk = model_runner.server_args.chunked_prefill_size
            chunk = chunk if chunk and chunk > 0 else None
            context_len = model_runner.model_config.context_len
        GraphBuckets.__init__(
            self,
            batch_sizes,
            capture_hidden_mode,
            max_extend_len,
            prefill_max_tokens,
            prefill_max_bs,
            full_token_buckets_only,
            chunk,
            context_len,
        )
        self.inputs = StaticInputs(self.max_bs, self.max_tokens, self.device)
        self.logits_indices = torch.arange(self.max_tokens, dtype=torch.int64, device=self.device)
        # [max prefill bs] int64: the last token row of each request of a prefill bucket's step
        # (computed on the device before the replay by _fill_ragged)
        self.prefill_logit_rows = torch.zeros(
            max(self.prefill_token_buckets, default=1), dtype=torch.int64, device=self.device
        )
        self._arange = np.arange(self.max_tokens, dtype=np.int64)  # host request starts
        if use_graphs:
            self.backend.init_cuda_graph_state(self.max_bs, self.max_tokens)
            if self.verify_backend is not None:
                self.verify_backend.init_cuda_graph_state(self.max_bs, self.max_tokens)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, LogitsProcessorOutput] = {}
        self.batches = {key: self._static_batch(key) for key in self.keys}
        if use_graphs:
            self.capture()

    # ------------------------------------------------------------------ selection
    def backend_of(self, key: GraphKey):
        """The attention backend key's graph captures: verify_backend for a verify bucket
        (more tokens than requests, not a prefill bucket) of bs <= verify_backend_max_bs and
        for a decode bucket (one token per request) of bs <= decode_backend_max_bs, else the
        runner's backend."""
        if self.is_prefill_key(key):
            return self.backend
        if key.num_tokens > key.bs and key.bs <= self.verify_backend_max_bs:
            return self.verify_backend
        if key.num_tokens == key.bs and key.bs <= self.decode_backend_max_bs:
            return self.verify_backend
        return self.backend

    # ------------------------------------------------------------------ static batches
    def _static_batch(self, key: GraphKey) -> ForwardBatch:
        """A ForwardBatch whose tensors are views of the persistent buffers for this key. A
        prefill bucket computes one logits row per request (prefill_logit_rows) and, where the
        runner captures LAST, FULL hidden states: [T, V] logits per bucket would cost memory
        and a T-row lm_head matmul, and its rounding could differ from the eager prefill's
        GEMV."""
        inp, d, b, n = self.inputs, self.inputs.dev, key.bs, key.num_tokens
        prefill = self.is_prefill_key(key)
        mode = self.capture_hidden_mode
        if prefill and mode == CaptureHiddenMode.LAST:
            mode = CaptureHiddenMode.FULL
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE
            if n == b
            else (ForwardMode.EXTEND if prefill else self.multi_token_mode),
            batch_size=b,
            input_ids=inp.region(d, 5, n),
            positions=inp.region(d, 6, n),
            out_cache_loc=inp.region(d, 7, n),
            req_pool_indices=inp.region(d, 0, b),
            seq_lens=inp.region(d, 1, b),
            extend_seq_lens=inp.region(d, 2, b),
            extend_prefix_lens=inp.region(d, 3, b),
            extend_start_loc=inp.region(d, 4, b),
            seq_lens_cpu=[1] * b,
            extend_seq_lens_cpu=[1] * b,
            extend_prefix_lens_cpu=[0] * b,
            logits_indices=self.prefill_logit_rows[:b] if prefill else self.logits_indices[:n],
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            attn_backend=self.backend_of(key),
            capture_hidden_mode=mode,
        )

    def _fill(
        self,
        key: GraphKey,
        req_pool_indices: list[int],
        seq_lens: list[int],
        extend_lens: list[int],
        input_ids: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> ForwardBatch:
        """Write one (padded) step into the persistent buffers; returns the key's batch with
        its *_cpu lists set to the padded values. input_ids: [t] int64 on the host or on the
        device (then copied device-to-device after the packed upload); out_cache_loc: [t]
        int64 on the host."""
        if key.num_tokens == key.bs:  # decode: every request and pad computes one token
            return self._fill_decode(key, req_pool_indices, seq_lens, input_ids, out_cache_loc)
        return self._fill_ragged(
            key, req_pool_indices, seq_lens, extend_lens, input_ids, out_cache_loc
        )

    def _fill_ragged(
        self,
        key: GraphKey,
        req_pool_indices: list[int],
        seq_lens: list[int],
        extend_lens: list[int],
        input_ids: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> ForwardBatch:
        """_fill for any key (requests computing extend_lens[i] >= 1 tokens each)."""
        t = int(input_ids.numel())
        on_host = input_ids.device.type == "cpu"
        seq, ext, pre = self.inputs.write_ragged(
            key.bs,
            key.num_tokens,
            req_pool_indices,
            seq_lens,
            extend_lens,
            input_ids.numpy() if on_host else None,
            t,
            out_cache_loc.numpy(),
        )
        fb = self.batches[key]
        if not on_host:  # ids already on the device (resolved there): queued after the upload
            fb.input_ids[:t].copy_(input_ids, non_blocking=True)
        if self.is_prefill_key(key):  # each request's last row, queued after the upload
            rows = self.prefill_logit_rows[: key.bs]
            torch.add(fb.extend_start_loc, fb.extend_seq_lens, out=rows)
            rows.sub_(1)
        fb.seq_lens_cpu = seq.tolist()
        fb.extend_seq_lens_cpu = ext.tolist()
        fb.extend_prefix_lens_cpu = pre.tolist()
        return fb

    def _fill_decode(
        self,
        key: GraphKey,
        req_pool_indices: list[int],
        seq_lens: list[int],
        input_ids: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> ForwardBatch:
        """_fill for a decode key (one token per request): the same buffer contents, written
        by StaticInputs.write_decode's slice assignments (every decode step of a CUDA server
        runs this, and its host time is what a small model's step waits on)."""
        b, bs = key.bs, len(seq_lens)
        on_host = input_ids.device.type == "cpu"
        seq = self.inputs.write_decode(
            b,
            req_pool_indices,
            seq_lens,
            input_ids.numpy() if on_host else None,
            out_cache_loc.numpy(),
            self._arange,
        )
        fb = self.batches[key]
        if not on_host:  # ids already on the device (resolved there): queued after the upload
            fb.input_ids[:bs].copy_(input_ids, non_blocking=True)
        fb.seq_lens_cpu = seq.tolist()
        fb.extend_seq_lens_cpu = [1] * b
        fb.extend_prefix_lens_cpu = (seq - 1).tolist()
        return fb

    # ------------------------------------------------------------------ capture
    def _dummy_fill(self, key: GraphKey) -> ForwardBatch:
        """The key's tokens split over its requests as evenly as they go (the first
        num_tokens % bs requests one more), each from position 0 into slot 0."""
        q, r = divmod(key.num_tokens, key.bs)
        lens = [q + 1] * r + [q] * (key.bs - r)
        return self._fill(
            key,
            [0] * key.bs,
            lens,
            lens,
            torch.zeros(key.num_tokens, dtype=torch.int64),
            torch.zeros(key.num_tokens, dtype=torch.int64),
        )

    def _run_model(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        out = self.model.forward(fb.input_ids, fb.positions, fb)
        self.runner.store_hidden(fb, out)  # captured: each replay writes the hidden state pool
        return out

    def capture(self) -> None:
        """Capture every key's graph. The garbage collector is paused meanwhile: a collection
        during a capture may free an unreachable CUDA graph of an earlier runner (a scheduler
        dropped by the caller), and destroying a graph is not permitted while a stream
        captures (CUDA invalidates the capture: CUBLAS_STATUS_EXECUTION_FAILED, then
        cudaErrorStreamCaptureInvalidated; it made the GPU tests, which build many
        schedulers in one process, fail at random)."""
        gc.collect()
        gc.disable()
        try:
            self._capture_all()
        finally:
            gc.enable()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for key in sorted(self.keys, key=lambda k: (k.num_tokens, k.bs), reverse=True):
            fb = self._dummy_fill(key)
            backend = self.backend_of(key)
            backend.init_forward_metadata_capture_cuda_graph(fb, self.longest_request(key))
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels, settle allocator
                    self._run_model(fb)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._run_model(fb)
            self.graphs[key] = graph
            self.outputs[key] = out
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured %d CUDA graphs (bs %s, up to %d tokens per request) in %.1f s",
            len(self.graphs),
            self.batch_sizes,
            self.max_extend_len,
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ replay
    def _execute(self, key: GraphKey, fb: ForwardBatch):
        """Run the filled static batch of `key`: replay its graph, or (use_graphs False) run it
        eagerly over the same padded buffers (CPU tests, debugging). Returns the model output,
        which a replay overwrites next time: copy what must outlive it."""
        backend = self.backend_of(key)
        if not self.use_graphs:
            backend.init_forward_metadata(fb)
            return self._run_model(fb)
        backend.init_forward_metadata_replay_cuda_graph(fb, self.longest_request(key))
        self.graphs[key].replay()
        return self.outputs[key]

    def replay(
        self, mwb: ModelWorkerBatch, capture_hidden_mode: CaptureHiddenMode | None = None
    ) -> LogitsProcessorOutput:
        """Run mwb (can_run must be true) through its graph; returns logits [R, V] float32 of
        its R = sum(num_logit_rows) logits rows (every token of a decode / verify step; a
        prefill's last num_logit_rows[i] tokens of request i) and, when a mode is captured,
        hidden states: [T, H'] of all T tokens for capture_hidden_mode FULL, else those of
        the logits rows (default: the captured mode).

        The logits are a view of the graph's output buffer, valid until the next replay of
        the same graph: every caller consumes them within its step, on the current stream
        (sampling, verification, logprobs), which orders those reads before any later replay.
        Not copying them saves a [T, V] float32 copy per step (131 MB at batch 256 of a
        128k vocabulary). The hidden states are a view too, under the same rule (the draft
        extend of a prefill reads them in its step; what later steps read went into the hidden
        state pool inside the graph)."""
        t = int(mwb.input_ids.numel())
        mode = self.capture_hidden_mode if capture_hidden_mode is None else capture_hidden_mode
        key = self.key_for(mwb, mode)
        fb = self._fill(
            key,
            mwb.req_pool_indices,
            mwb.seq_lens,
            mwb.extend_seq_lens,
            as_int64(mwb.input_ids),
            as_int64(mwb.out_cache_loc),
        )
        out = self._execute(key, fb)
        hidden = out.hidden_states
        logits = out.next_token_logits[:t]  # [T, V]: every graph row is a logits row
        if mwb.num_logit_rows != mwb.extend_seq_lens:  # a prefill: each request's last row
            if self.is_prefill_key(key):  # the graph's rows are the requests' last tokens
                # one request: 0 or 1 rows (no input logprobs); several: one each (key_for)
                logits = out.next_token_logits[: sum(mwb.num_logit_rows)]
            if mwb.batch_size == 1:  # LAST hidden states, or a verify bucket's rows
                rows = slice(t - mwb.num_logit_rows[0], t)
                if not self.is_prefill_key(key):
                    logits = logits[rows]
                if hidden is not None and mode != CaptureHiddenMode.FULL:
                    hidden = hidden[rows]
        return LogitsProcessorOutput(
            next_token_logits=logits,
            hidden_states=hidden[:t] if hidden is not None else None,
        )
