"""FlashInfer attention backend: flashinfer-python's paged decode / prefill wrappers over the
token-indexed KV pool (page size 1).

The pool's k_buffer[layer] [slots + 1, Hkv, D] is a paged cache of one-token pages in NHD
layout, so request i's page list is req_to_token[req_pool_indices[i], :seq_lens[i]]. A step in
which every request computes one token runs BatchDecodeWithPagedKVCacheWrapper (tensor cores
when the GQA group is >= 4, upstream's rule; CUDA-core decode also lacks groups 5 and 7). Any
other step (prefill over a cached prefix, ragged verify with 1 + d_i tokens) runs
BatchPrefillWithPagedKVCacheWrapper with causal=True: FlashInfer aligns each request's causal
mask to the end of its KV, so query j of request i sees keys 0 .. prefix_i + j.

One plan per forward (init_forward_metadata, or the CUDA-graph hooks) from the host-side
lengths; the page lists are gathered on the device by one Triton kernel, without a host sync.
Token rows beyond the last request (a CUDA-graph bucket may hold more rows than the step uses)
are given to the last request together with as many extra pages pointing at padding slot 0:
its real queries keep their causal alignment and the extra rows are garbage nobody reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.layers.attention import flashinfer_replan
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.flashinfer_workspace import (
    float_workspace,
    graph_workspace_bytes,
    workspace_overflow_bytes,
)
from sglang.srt.layers.attention.paged_layout import PagedLayout, fill_kv_indices, paged_layout

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
EAGER_RING = 2  # eager wrappers per kind, used in turn (see _plan on pinned plan buffers)


def check_dtype(dtype: torch.dtype) -> None:
    """Raise ValueError unless FlashInfer has kernels for this KV / activation dtype."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"--attention-backend flashinfer needs --dtype bfloat16 or float16 (FlashInfer has "
            f"no {dtype} kernels); use --attention-backend triton or torch_native for it"
        )


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless FlashInfer's paged kernels are built for this head_dim."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"--attention-backend flashinfer supports head_dim {SUPPORTED_HEAD_DIMS}, got "
            f"{head_dim}; use --attention-backend triton or torch_native"
        )


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    return num_qo_heads // num_kv_heads >= 4


@dataclass
class FlashInferMetadata:
    """What every layer of one forward runs: a planned wrapper and the shapes it was planned
    for."""

    wrapper: Any  # BatchDecode- or BatchPrefillWithPagedKVCacheWrapper, planned
    is_decode: bool
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # q, KV and output dtype


@dataclass
class _GraphBuffers:
    """Persistent device buffers every CUDA-graph wrapper reads (shared: one graph replays at a
    time and each replay re-plans its own wrapper into them first)."""

    qo_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    last_page_len: torch.Tensor  # [max_bs] int32, ones
    kv_indices: torch.Tensor  # [max_bs * max_context_len + max_num_tokens] int32


def _num_qo_heads(runner) -> int | None:
    """Query heads of the runner's model: ModelRunner.model_config or DraftRunner.model.config."""
    for cfg in (
        getattr(runner, "model_config", None),
        getattr(getattr(runner, "model", None), "config", None),
    ):
        n = getattr(cfg, "num_attention_heads", None)
        if n:
            return int(n)
    return None


class FlashInferAttnBackend(AttentionBackend):
    """Attention through flashinfer-python (tested with 0.6.18; kernels are JIT-compiled on
    first use). Args: model_runner (device, dtype, req_to_token_pool and the model's number of
    query heads), num_qo_heads (overrides the runner's). Raises ValueError off CUDA, for a
    float32 model, a head_dim other than 64 / 128 / 256, or when the number of query heads
    cannot be found; ImportError without flashinfer."""

    supports_cuda_graph = True
    saves_kv_through_pool = True  # forward: pool.set_kv_buffer, then reads the pool

    def __init__(self, model_runner, num_qo_heads: int | None = None) -> None:
        from flashinfer import (
            BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper,
        )

        self._decode_cls = BatchDecodeWithPagedKVCacheWrapper
        self._prefill_cls = BatchPrefillWithPagedKVCacheWrapper
        self.model_runner = model_runner
        self.device = torch.device(getattr(model_runner, "device", "cpu"))
        if self.device.type != "cuda":
            raise ValueError(
                f"--attention-backend flashinfer needs a CUDA device, got {self.device}"
            )
        if self.device.index is None:  # one spelling, as FlashInfer compares devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        if getattr(model_runner, "dtype", None) is not None:
            check_dtype(model_runner.dtype)
        for pool in (getattr(model_runner, n, None) for n in ("token_to_kv_pool", "kv_pool")):
            if pool is not None:  # ModelRunner / DraftRunner: fail at startup, not mid-step
                check_dtype(pool.dtype)
                check_head_dim(pool.head_dim)
        self.num_qo_heads = num_qo_heads or _num_qo_heads(model_runner)
        if not self.num_qo_heads:
            raise ValueError("flashinfer backend: the model runner gives no num_attention_heads")
        self.workspace = float_workspace(self.device)
        self._eager: dict[tuple[bool, bool], list] = {}  # (is_decode, tensor cores) -> ring
        self._eager_calls = 0
        self._plan_events: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its plan
        self._sm_scale: float | None = None  # None: FlashInfer's 1/sqrt(head_dim) until a layer
        self._graph: _GraphBuffers | None = None
        # (bs, num_tokens) -> (CUDA-graph wrapper, is_decode)
        self._graph_wrappers: dict[tuple[int, int], tuple[Any, bool]] = {}
        # SGLANG_FLASHINFER_LEAN_PLAN: graph replays re-plan through flashinfer_replan
        self._lean = flashinfer_replan.lean_plan_enabled()
        # (q heads, KV heads, head_dim, dtype) -> its re-planner
        self._replanners: dict[tuple, flashinfer_replan.GraphReplanner] = {}
        self._lean_ok: dict[Any, bool] = {}  # graph wrapper -> supported, once planned

    # ------------------------------------------------------------------ eager
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.batch_size == 0:
            fb.attn_metadata = None
            return
        pool = fb.token_to_kv_pool
        layout = paged_layout(fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.num_tokens)
        kv_indices = torch.empty(layout.num_pages, dtype=torch.int32, device=self.device)
        self._fill(fb, layout, kv_indices)
        use_tc = decode_uses_tensor_cores(self.num_qo_heads, pool.head_num)
        ring = self._eager.get((layout.is_decode, use_tc))
        if ring is None:
            ring = [self._new_wrapper(layout.is_decode, use_tc) for _ in range(EAGER_RING)]
            self._eager[(layout.is_decode, use_tc)] = ring
        self._eager_calls += 1
        wrapper = ring[self._eager_calls % EAGER_RING]
        fb.attn_metadata = self._plan(wrapper, layout.is_decode, layout, kv_indices, pool)

    def _new_wrapper(self, is_decode: bool, use_tc: bool, bs: int | None = None):
        """An eager wrapper, or (bs given) a CUDA-graph wrapper over the persistent buffers."""
        ws = self.workspace
        if bs is None:
            if is_decode:
                return self._decode_cls(ws, "NHD", use_tensor_cores=use_tc, backend="fa2")
            return self._prefill_cls(ws, "NHD", backend="fa2")
        g = self._graph
        if is_decode:
            return self._decode_cls(
                ws,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=use_tc,
                paged_kv_indptr_buffer=g.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=g.kv_indices,
                paged_kv_last_page_len_buffer=g.last_page_len[:bs],
                backend="fa2",
            )
        return self._prefill_cls(
            ws,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=g.qo_indptr[: bs + 1],
            paged_kv_indptr_buf=g.kv_indptr[: bs + 1],
            paged_kv_indices_buf=g.kv_indices,
            paged_kv_last_page_len_buf=g.last_page_len[:bs],
            backend="fa2",
        )

    def _fill(self, fb: ForwardBatch, layout: PagedLayout, kv_indices: torch.Tensor) -> None:
        fill_kv_indices(
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layout.extra_rows,
            kv_indices,
        )

    def _plan(
        self,
        wrapper,
        is_decode: bool,
        layout: PagedLayout,
        kv_indices: torch.Tensor,
        pool,
        graph: bool = False,
    ) -> FlashInferMetadata:
        """Plan `wrapper` for this step (host-side indptrs: no device sync in plan()).

        plan() writes its schedule into the wrapper's pinned host buffer and uploads it with an
        async copy; wait until the previous plan's upload of this wrapper has run before the
        buffer is rewritten (the CPU may run ahead of the GPU). Its inputs are passed in pinned
        memory (flashinfer_replan.plan_inputs), so its own uploads do not wait for the GPU.
        A CUDA-graph wrapper (`graph`) that plan() ran on once is re-planned by
        flashinfer_replan instead (the default; SGLANG_FLASHINFER_LEAN_PLAN=0 keeps plan();
        kv_indices is then already the wrapper's own buffer, filled in place)."""
        check_dtype(pool.dtype)
        check_head_dim(pool.head_dim)
        nq, nkv, d = self.num_qo_heads, pool.head_num, pool.head_dim
        if nq % nkv:
            raise ValueError(f"num_qo_heads {nq} is not a multiple of num_kv_heads {nkv}")
        previous = self._plan_events.get(id(wrapper))
        if previous is not None:
            previous.synchronize()
        if graph and self._lean_ok.get(wrapper, False):
            shape = (nq, nkv, d, pool.dtype)  # what the wrapper was planned for at capture
            replanner = self._replanners.get(shape)
            if replanner is None:
                replanner = self._replanners[shape] = flashinfer_replan.GraphReplanner(*shape)
            if is_decode:
                replanner.replan(wrapper, layout.kv_indptr)
            else:
                replanner.replan_prefill(wrapper, layout.qo_indptr, layout.kv_indptr)
        else:
            # pinned: plan()'s own uploads then do not wait for the GPU
            host = flashinfer_replan.plan_inputs(layout, pin=True, is_decode=is_decode)
            kw = dict(q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=self._sm_scale)
            if is_decode:
                wrapper.plan(
                    host.kv_indptr, kv_indices, host.last_page_len, nq, nkv, d, 1,
                    non_blocking=True, **kw,
                )  # fmt: skip
            else:
                wrapper.plan(
                    host.qo_indptr, host.kv_indptr, kv_indices, host.last_page_len,
                    nq, nkv, d, 1, causal=True, non_blocking=True, seq_lens=host.kv_lens,
                    **kw,
                )  # fmt: skip
            if graph and self._lean and wrapper not in self._lean_ok:  # later replays may
                self._lean_ok[wrapper] = flashinfer_replan.supported(wrapper)  # re-plan lean
        event = torch.cuda.Event()
        event.record()
        self._plan_events[id(wrapper)] = event
        return FlashInferMetadata(wrapper, is_decode, nq, nkv, d, pool.dtype)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Persistent buffers for graphs of up to max_bs requests and max_num_tokens tokens.
        A second runner over this backend (a draft's decode graphs after its extend graphs)
        keeps the buffers and wrappers when they are large enough: graphs of one (bs, tokens)
        key then share a wrapper, which each replay re-plans first."""
        max_context_len = self.model_runner.req_to_token_pool.req_to_token.shape[1]
        dev, i32 = self.device, torch.int32
        g = self._graph
        if (
            g is not None
            and g.qo_indptr.numel() >= max_bs + 1
            and g.kv_indices.numel() >= max_bs * max_context_len + max_num_tokens
        ):
            return
        head_dim = getattr(getattr(self.model_runner, "model_config", None), "head_dim", 128)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        need = graph_workspace_bytes(max_num_tokens, self.num_qo_heads, head_dim, sms)
        self.workspace = float_workspace(dev, need)  # graph wrappers are built after this
        self._graph = _GraphBuffers(
            qo_indptr=torch.zeros(max_bs + 1, dtype=i32, device=dev),
            kv_indptr=torch.zeros(max_bs + 1, dtype=i32, device=dev),
            last_page_len=torch.ones(max_bs, dtype=i32, device=dev),
            kv_indices=torch.zeros(
                max_bs * max_context_len + max_num_tokens, dtype=i32, device=dev
            ),
        )
        self._graph_wrappers.clear()
        self._lean_ok.clear()

    def init_forward_metadata_capture_cuda_graph(
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        fb = forward_batch
        key = (fb.batch_size, fb.num_tokens)
        if self._graph is None:
            raise RuntimeError("init_cuda_graph_state must run before capturing a graph")
        is_decode = fb.num_tokens == fb.batch_size
        use_tc = decode_uses_tensor_cores(self.num_qo_heads, fb.token_to_kv_pool.head_num)
        shared = key in self._graph_wrappers  # captured before by another runner
        if not shared:
            wrapper = self._new_wrapper(is_decode, use_tc, bs=fb.batch_size)
            self._graph_wrappers[key] = (wrapper, is_decode)
        try:
            self.init_forward_metadata_replay_cuda_graph(fb, max_extend_len)
        except RuntimeError as e:
            asked = workspace_overflow_bytes(e)
            if asked is None:
                raise
            if shared:  # a new wrapper would leave the earlier runner's graph on a stale plan
                raise RuntimeError(
                    f"FlashInfer workspace overflow while capturing graph {key}, whose wrapper "
                    "another runner's graph shares; capture the runner with more tokens first "
                    "or set SGLANG_FLASHINFER_WORKSPACE_SIZE larger"
                ) from e
            # Grow the shared workspace and re-plan this graph's wrapper on it. Graphs captured
            # before keep the buffer their wrappers were planned on (still referenced).
            grown = self.workspace.numel() + asked + (64 << 20)
            logger.info("FlashInfer workspace grown to %d MiB for graph %s", grown >> 20, key)
            self.workspace = float_workspace(self.device, grown)
            wrapper = self._new_wrapper(is_decode, use_tc, bs=fb.batch_size)
            self._graph_wrappers[key] = (wrapper, is_decode)
            self.init_forward_metadata_replay_cuda_graph(fb, max_extend_len)

    def init_forward_metadata_replay_cuda_graph(
        self, forward_batch: ForwardBatch, max_extend_len: int
    ) -> None:
        fb = forward_batch
        key = (fb.batch_size, fb.num_tokens)
        entry = self._graph_wrappers.get(key)
        if entry is None:
            raise KeyError(f"no CUDA graph captured for (bs, num_tokens) = {key}")
        layout = paged_layout(fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.num_tokens)
        if layout.num_pages > self._graph.kv_indices.numel():
            raise RuntimeError(
                f"{layout.num_pages} KV pages exceed the CUDA-graph index buffer "
                f"({self._graph.kv_indices.numel()})"
            )
        kv_indices = self._graph.kv_indices[: layout.num_pages]
        self._fill(fb, layout, kv_indices)
        wrapper, is_decode = entry
        fb.attn_metadata = self._plan(
            wrapper, is_decode, layout, kv_indices, fb.token_to_kv_pool, graph=True
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H * D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:  # [num_tokens, H * D] in q's dtype
        m: FlashInferMetadata = forward_batch.attn_metadata
        h, d = layer.tp_q_head_num, layer.head_dim
        if (h, layer.tp_k_head_num, d) != (m.num_qo_heads, m.num_kv_heads, m.head_dim):
            raise ValueError(
                f"layer {layer.layer_id} has (heads, kv heads, head_dim) = "
                f"{(h, layer.tp_k_head_num, d)}, the step was planned for "
                f"{(m.num_qo_heads, m.num_kv_heads, m.head_dim)}"
            )
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        wrapper = m.wrapper
        if getattr(wrapper, "_sm_scale", None) != layer.scaling:
            # plan() keeps sm_scale in wrapper._sm_scale and run() reads it from there
            # (flashinfer 0.6); later plans pass it directly.
            wrapper._sm_scale = self._sm_scale = layer.scaling
        # Pages of one token: the [slots + 1, Hkv, D] buffers are NHD caches with page_size 1.
        kv = (pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id))
        out = wrapper.run(q.reshape(-1, h, d).to(m.dtype).contiguous(), kv)  # [T, H, D]
        return out.reshape(-1, h * d).to(q.dtype)
