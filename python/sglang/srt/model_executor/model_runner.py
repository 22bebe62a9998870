"""ModelRunner: owns the model weights, the KV pools' storage and the attention backend, and
runs one forward for a ModelWorkerBatch. It holds no request state.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import ModelWorkerBatch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.hidden_state_pool import HiddenStatePool, spec_hidden_width
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_buckets import graph_batch_sizes
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    positions_and_starts,
)
from sglang.srt.model_executor.forward_counters import ForwardCounters
from sglang.srt.model_loader import get_model
from sglang.srt.server_args import ServerArgs, env_flag
from sglang.srt.server_args_resolve import default_attention_backend
from sglang.srt.utils.h2d import int64_to_device

# Largest bs bucket whose verify graphs use Triton attention under a FlashInfer target
# (ModelRunner.triton_verify_backend): beyond it the host plan is spread over many requests,
# and drafting rarely pays there.
TRITON_VERIFY_MAX_BS = 32
# Default of SGLANG_TRITON_DECODE_GRAPH_MAX_BS (ModelRunner.triton_decode_graph_max_bs): decode
# graphs of bs buckets up to it use Triton attention under a FlashInfer target. 8: on the H200
# (twenty-second session) the grouped kernel in a graph of 32 layers took 5.5-9.4 us per layer
# against FlashInfer's 10.0-12.6 at bs 1-4 up to 1024 tokens of context (9.2 vs 12.8 at bs 16,
# 256 tokens), but 32.2 vs 28.9 at bs 4 and 4096 tokens, 32.0 vs 29.2 at bs 16 and 1024.
TRITON_DECODE_GRAPH_MAX_BS = 8


logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30  # KV budget on CPU when --max-total-tokens is not given
CPU_MAX_DEFAULT_TOKENS = 65536


class ModelRunner:
    """Loads the model and runs forwards.

    Attributes: model, req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator (the
    pools' storage lives here because it is sized after the weights are loaded; the scheduler
    is their only user), attn_backend, max_total_num_tokens.
    """

    def __init__(self, model_config: ModelConfig, server_args: ServerArgs) -> None:
        self.model_config = model_config
        self.server_args = server_args
        self.device = torch.device(server_args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = model_config.dtype
        self.init_torch_settings()
        self.load_model()
        self.init_memory_pool()
        # --attention-backend, or the device/dtype default (flashinfer > triton on CUDA)
        self.attention_backend_name = server_args.attention_backend or default_attention_backend(
            self.device.type, self.dtype, model_config.head_dim
        )
        self.attn_backend = create_attention_backend(self.attention_backend_name, self)
        self.cuda_graph_runner: CudaGraphRunner | None = None
        self.forward_counters = ForwardCounters()  # graph / eager steps, for /get_server_info

    def init_torch_settings(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.server_args.random_seed is not None:
            torch.manual_seed(self.server_args.random_seed)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        self.model = get_model(
            self.model_config,
            load_format=self.server_args.load_format,
            device=str(self.device),
            random_seed=self.server_args.random_seed,
        )
        logger.info("Model loaded in %.1f s (dtype %s)", time.perf_counter() - t0, self.dtype)

    def profile_max_num_tokens(self) -> int:
        """KV slots of the token pool (int, tokens): --max-total-tokens when given, capped on
        CUDA at what fits in --mem-fraction-static of the GPU after the weights (upstream caps
        it the same way and warns); else SGLANG_MAX_TOTAL_TOKENS_DEFAULT as given (the test
        suite: many engines share one GPU, so the fraction of the whole card means nothing);
        else that fit on CUDA, or the CPU default. A slot holds the target's KV of every layer
        and, when speculating, the hidden state the draft reads; the draft's own KV pool (one
        layer per slot for EAGLE-3) and weights come out of the 1 - --mem-fraction-static
        reserve, with the CUDA graphs and activations.

        Raises RuntimeError when the GPU cannot hold 128 slots and no smaller
        --max-total-tokens was asked for."""
        mc = self.model_config
        per_token = MHATokenToKVPool.bytes_per_token(
            self.dtype, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers
        ) + HiddenStatePool.bytes_per_token(self.hidden_width, self.dtype)
        requested = self.server_args.max_total_tokens
        if requested is None and env_flag("MAX_TOTAL_TOKENS_DEFAULT"):
            return int(env_flag("MAX_TOTAL_TOKENS_DEFAULT"))
        if self.device.type != "cuda":
            if requested is not None:
                return requested
            return min(CPU_MAX_DEFAULT_TOKENS, CPU_DEFAULT_KV_BYTES // per_token)
        free, total = torch.cuda.mem_get_info(self.device)
        frac = self.server_args.mem_fraction_static or 0.85
        fit = int(max(0.0, free - total * (1 - frac)) // per_token)
        if requested is not None and requested <= fit:
            return requested
        if fit < 128:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free, "
                f"--mem-fraction-static {frac} leaves room for {fit} tokens; raise it, lower "
                "--max-total-tokens or use a smaller model"
            )
        if requested is not None:
            logger.warning(
                "--max-total-tokens %d does not fit in --mem-fraction-static %.2f of the GPU "
                "(%.1f GiB free after the weights, %d bytes per token): using %d tokens",
                requested,
                frac,
                free / 2**30,
                per_token,
                fit,
            )
        return fit

    @property
    def hidden_width(self) -> int:
        """Width of the hidden state kept per KV slot (0: not speculating, no pool)."""
        sa, mc = self.server_args, self.model_config
        return spec_hidden_width(sa.speculative_algorithm, mc.hidden_size)

    def store_hidden(self, fb: ForwardBatch, out: LogitsProcessorOutput) -> None:
        """Write out's hidden states into the hidden state pool at the KV slots of their
        tokens, when the runner keeps one and out has one hidden row per token of fb (a
        decode or verify step with LAST, a prefill with FULL). Called by every target forward,
        eager or captured in a CUDA graph (whose static out_cache_loc makes the write part of
        the replay)."""
        h = out.hidden_states
        if self.hidden_pool is None or h is None or h.shape[0] != fb.out_cache_loc.shape[0]:
            return
        self.hidden_pool.write(fb.out_cache_loc, h)

    def init_memory_pool(self) -> None:
        mc, sa = self.model_config, self.server_args
        self.max_total_num_tokens = self.profile_max_num_tokens()
        self.req_to_token_pool = ReqToTokenPool(
            sa.max_running_requests + 1, mc.context_len + 8, self.device
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            self.dtype,
            mc.num_key_value_heads,
            mc.head_dim,
            mc.num_hidden_layers,
            self.device,
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_num_tokens)
        # speculative decoding: the target's hidden state of every KV slot, for the draft
        self.hidden_pool = (
            HiddenStatePool(self.max_total_num_tokens, self.hidden_width, self.dtype, self.device)
            if self.hidden_width
            else None
        )
        pool = f", with a hidden state pool of width {self.hidden_width} for the draft"
        logger.info(
            "KV cache: %d tokens%s",
            self.max_total_num_tokens,
            pool if self.hidden_pool is not None else "",
        )

    def init_cuda_graphs(
        self, capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL, max_extend_len=1
    ) -> None:
        """Capture decode (and, max_extend_len = K + 1, verify) graphs, unless on CPU, under
        --disable-cuda-graph, or with an attention backend that cannot be captured. Called by
        the worker once the model is fully set up (EAGLE-3 capture layers included)."""
        sa = self.server_args
        if self.device.type != "cuda" or sa.disable_cuda_graph:
            return
        if not self.attn_backend.supports_cuda_graph:
            logger.warning(
                "attention backend %s cannot run in CUDA graphs; running eagerly",
                self.attention_backend_name,
            )
            return
        sizes = graph_batch_sizes(sa.cuda_graph_bs, sa.cuda_graph_max_bs, sa.max_running_requests)
        # One Triton backend serves both graph kinds; SGLANG_TRITON_VERIFY=0 turns off its
        # verify graphs even when decode graphs still take it (and the reverse).
        verify = self.triton_verify_backend(max_extend_len)
        decode_max_bs = self.triton_decode_graph_max_bs()
        triton = verify
        if triton is None and decode_max_bs > 0:
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            triton = TritonAttnBackend(self)
        self.cuda_graph_runner = CudaGraphRunner(
            self,
            capture_hidden_mode,
            max_extend_len,
            sizes,
            prefill_max_tokens=sa.cuda_graph_prefill_max_tokens or 0,  # None: not resolved
            verify_backend=triton,
            verify_backend_max_bs=TRITON_VERIFY_MAX_BS if verify is not None else 0,
            decode_backend_max_bs=decode_max_bs,
            prefill_max_bs=sa.cuda_graph_prefill_max_bs,
        )

    def triton_decode_graph_max_bs(self) -> int:
        """Largest bs bucket whose decode graphs capture Triton attention (the GQA-grouped
        split-K kernel, triton_ops/decode_grouped.py) when the target runs FlashInfer:
        SGLANG_TRITON_DECODE_GRAPH_MAX_BS (default TRITON_DECODE_GRAPH_MAX_BS); 0 for another
        backend or a head size the Triton kernels do not take. Raises ValueError on a value
        that is not a non-negative integer.

        Why: FlashInfer plans its decode wrapper on the host before every replay, and at batch
        1 of the Llama-3.1-8B shape its tensor-core decode took 8.7 + 2.3 us per layer on the
        H200 (prefill kernel + merge, ~300 tokens of context), while the Triton kernels read
        seq_lens and req_to_token on the device (no plan) in one or two kernels. Both read and
        write the same paged KV pool."""
        from sglang.srt.layers.attention.triton_backend import head_dim_supported

        raw = env_flag("TRITON_DECODE_GRAPH_MAX_BS", str(TRITON_DECODE_GRAPH_MAX_BS))
        try:
            max_bs = int(raw)
        except ValueError:
            max_bs = -1
        if max_bs < 0:
            raise ValueError(
                f"SGLANG_TRITON_DECODE_GRAPH_MAX_BS must be a non-negative integer, got {raw!r}"
            )
        if self.attention_backend_name != "flashinfer":
            return 0
        if not head_dim_supported(self.model_config.head_dim):
            return 0
        return max_bs

    def triton_verify_backend(self, max_extend_len: int):
        """The Triton attention backend for the verify graphs of small batches when the target
        runs FlashInfer (None otherwise, under SGLANG_TRITON_VERIFY=0, or for a head size the
        Triton kernels do not take).

        On by default since the twenty-first session. Its GPU test
        (test_triton_verify_under_flashinfer_is_as_close_as_flashinfer: each bf16 path's
        verify logits against an fp32 torch_native reference) passed on the H200, and over 16
        greedy MT-Bench trajectories (SmolLM2 + its EAGLE-3 draft, in-process static K = 3 at
        batch 16, 96 steps) it accepted 2102 of 4992 drafts against 2048 with FlashInfer verify
        graphs, at 2.31 against 3.32-3.37 ms per step. The twentieth session had turned it
        off after one batch-1 trajectory accepted fewer drafts (98 against 163 of 408); one
        trajectory per kernel shows no bug either way, since bf16 rounding moves a greedy
        trajectory.

        Why: a FlashInfer prefill wrapper is planned on the host before every replay; at
        batch 1 on the H200 that planning and its uploads cost about 0.5 ms of a drafting
        step's host time (in-process static K = 3: 2.52 ms per step with FlashInfer, 1.95
        with Triton attention throughout), while Triton's kernels read seq_lens and
        req_to_token on the device and need no plan. Both read and write the same paged KV
        pool; decode graphs take Triton on their own terms (triton_decode_graph_max_bs)."""
        from sglang.srt.layers.attention.triton_backend import (
            TritonAttnBackend,
            head_dim_supported,
        )

        if max_extend_len <= 1 or self.attention_backend_name != "flashinfer":
            return None
        if env_flag("TRITON_VERIFY", "1") == "0":
            return None
        if not head_dim_supported(self.model_config.head_dim):
            return None
        return TritonAttnBackend(self)

    # ------------------------------------------------------------------
    def forward_worker_batch(
        self,
        mwb: ModelWorkerBatch,
        forward_mode: ForwardMode | None = None,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
    ) -> LogitsProcessorOutput:
        """Run mwb: replayed through a CUDA graph when one fits, eagerly otherwise. Returns
        logits [num_logit_rows, V] float32 (+ hidden states per capture_hidden_mode)."""
        t0 = time.perf_counter()
        g = self.cuda_graph_runner
        graph = g is not None and g.can_run(mwb, capture_hidden_mode)
        if graph:
            out = g.replay(mwb, capture_hidden_mode)
        else:
            fb = self.build_forward_batch(mwb)
            if forward_mode is not None:
                fb.forward_mode = forward_mode
            fb.capture_hidden_mode = capture_hidden_mode
            out = self.forward(fb)
        prefill = mwb.forward_mode == ForwardMode.EXTEND
        self.forward_counters.add(
            prefill, graph, int(mwb.input_ids.numel()), time.perf_counter() - t0
        )
        return out

    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        """The eager ForwardBatch of mwb: its metadata computed with numpy and moved to the
        device in one copy (with the ids and KV slots when they are on the host), instead of
        one small pageable copy per vector."""
        dev = self.device
        positions, starts = positions_and_starts(mwb.extend_prefix_lens, mwb.extend_seq_lens)
        ends = starts + np.asarray(mwb.extend_seq_lens, dtype=np.int64)
        rows = np.asarray(mwb.num_logit_rows, dtype=np.int64)
        first = np.cumsum(rows) - rows  # each request's first logits row
        logits_indices = np.arange(int(rows.sum()), dtype=np.int64) + np.repeat(
            ends - rows - first, rows
        )
        parts = [
            positions,
            starts,
            logits_indices,
            mwb.req_pool_indices,
            mwb.seq_lens,
            mwb.extend_seq_lens,
            mwb.extend_prefix_lens,
        ]
        host = [t for t in (mwb.input_ids, mwb.out_cache_loc) if t.device.type == "cpu"]
        moved = int64_to_device(parts + host, dev)
        positions, starts, logits_indices, pools, seq, ext, pre = moved[:7]
        rest = iter(moved[7:])
        input_ids = next(rest) if mwb.input_ids.device.type == "cpu" else mwb.input_ids
        out_cache_loc = next(rest) if mwb.out_cache_loc.device.type == "cpu" else mwb.out_cache_loc
        return ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=mwb.batch_size,
            input_ids=input_ids.to(dev, torch.int64),
            positions=positions,
            out_cache_loc=out_cache_loc.to(dev, torch.int64),
            req_pool_indices=pools,
            seq_lens=seq,
            extend_seq_lens=ext,
            extend_prefix_lens=pre,
            extend_start_loc=starts,
            seq_lens_cpu=list(mwb.seq_lens),
            extend_seq_lens_cpu=list(mwb.extend_seq_lens),
            extend_prefix_lens_cpu=list(mwb.extend_prefix_lens),
            logits_indices=logits_indices,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run the model; returns logits for forward_batch.logits_indices rows."""
        self.attn_backend.init_forward_metadata(forward_batch)
        fb = forward_batch
        out = self.model.forward(fb.input_ids, fb.positions, fb)
        self.store_hidden(fb, out)
        return out
