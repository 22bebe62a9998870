"""DraftRunner: the EAGLE / EAGLE-3 draft model, its KV pool and its attention backend.

The draft KV pool is indexed by the same token slots as the target's (a draft KV entry for
position t lives at the slot of the target's token t), so the scheduler's single allocator and
req_to_token table serve both pools, and the radix cache shares draft KV with target KV.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    positions_and_starts,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sglang.srt.speculative.draft_config import load_draft_model
from sglang.srt.speculative.draft_cuda_graph_runner import (
    DraftChainGraphRunner,
    DraftDecodeGraphRunner,
    DraftExtendGraphRunner,
)
from sglang.srt.utils.h2d import int64_to_device


class DraftRunner:
    def __init__(self, draft_path: str, target: ModelRunner) -> None:
        self.device = target.device
        self.dtype = target.dtype
        self.req_to_token_pool = target.req_to_token_pool
        self.model = load_draft_model(
            draft_path, target.model, target.model_config, str(self.device), self.dtype
        )
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_pool = MHATokenToKVPool(
            target.max_total_num_tokens,
            self.dtype,
            cfg.num_key_value_heads,
            head_dim,
            cfg.num_hidden_layers,  # EAGLE-3: 1; EAGLE: one per draft decoder layer
            self.device,
        )
        self.attn_backend = create_attention_backend(target.attention_backend_name, self)
        self.graph_runner: DraftDecodeGraphRunner | None = None
        self.extend_graph_runner: DraftExtendGraphRunner | None = None
        self.chain_graph_runner: DraftChainGraphRunner | None = None

    @property
    def token_to_kv_pool(self) -> MHATokenToKVPool:
        return self.kv_pool

    def init_cuda_graphs(
        self, batch_sizes: list[int], max_extend_len: int, use_graphs: bool = True
    ) -> None:
        """Capture the catch-up draft extend (up to max_extend_len = K + 1 tokens per request)
        and the single-token draft steps (EAGLE-3 drafts whose attention backend can be
        captured; anything else keeps running eagerly)."""
        if not isinstance(self.model, LlamaForCausalLMEagle3):
            return
        if use_graphs and not getattr(self.attn_backend, "supports_cuda_graph", False):
            return
        self.extend_graph_runner = DraftExtendGraphRunner(
            self, batch_sizes, max_extend_len, use_graphs
        )  # first: the larger token count sizes the shared attention buffers
        self.graph_runner = DraftDecodeGraphRunner(self, batch_sizes, use_graphs)

    def init_chain_graphs(
        self, hidden_pool, batch_sizes: list[int], num_steps: int, use_graphs: bool = True
    ) -> bool:
        """Capture whole greedy chain drafting steps (DraftChainGraphRunner) for the bs
        buckets batch_sizes and K = num_steps, where they apply: an EAGLE-3 draft whose head
        size the Triton attention kernels take. Returns whether they were set up."""
        from sglang.srt.layers.attention.triton_backend import head_dim_supported

        if not isinstance(self.model, LlamaForCausalLMEagle3) or not batch_sizes:
            return False
        if not head_dim_supported(self.kv_pool.head_dim):
            return False
        self.chain_graph_runner = DraftChainGraphRunner(
            self, hidden_pool, batch_sizes, num_steps, use_graphs
        )
        return True

    def catch_up(
        self,
        input_ids: torch.Tensor,  # [T] int64 (device)
        hidden_states: torch.Tensor,  # [T, 3 * target_hidden]
        req_pool_indices: list[int],  # [bs]
        prefix_lens: list[int],  # [bs]
        extend_lens: list[int],  # [bs] (>= 1)
        out_cache_loc: torch.Tensor,  # [T] int64 KV slots (CPU)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up draft extend of a drafting step: `forward`, replayed through a CUDA
        graph when one fits. Same arguments and results as `forward`."""
        g = self.extend_graph_runner
        if g is not None and g.fits(extend_lens):
            return g.extend(
                input_ids, hidden_states, req_pool_indices, prefix_lens, extend_lens, out_cache_loc
            )
        return self.forward(
            input_ids, hidden_states, req_pool_indices, prefix_lens, extend_lens, out_cache_loc
        )

    def decode(
        self,
        input_ids: torch.Tensor,  # [m] int64 (device)
        hidden_states: torch.Tensor,  # [m, draft_hidden]
        req_pool_indices: list[int],  # [m]
        positions: list[int],  # [m] position of each row's token
        out_cache_loc: torch.Tensor,  # [m] int64 KV slots (CPU)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One single-token draft step per row: replayed through a CUDA graph when captured,
        eagerly otherwise. Returns (logits [m, draft_vocab] float32, hidden [m, draft_hidden])."""
        g = self.graph_runner
        if g is not None and g.can_run_decode(len(positions)):
            return g.decode(input_ids, hidden_states, req_pool_indices, positions, out_cache_loc)
        return self.forward(
            input_ids,
            hidden_states,
            req_pool_indices,
            positions,
            [1] * len(positions),
            out_cache_loc,
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64 (device)
        hidden_states: torch.Tensor,  # [T, 3 * target_hidden] or [T, draft_hidden]
        req_pool_indices: list[int],  # [bs]
        prefix_lens: list[int],  # [bs] draft positions before this call's tokens
        extend_lens: list[int],  # [bs] tokens per request (>= 1)
        out_cache_loc: torch.Tensor,  # [T] int64 KV slots (CPU: moved with the metadata)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward over ragged requests (its metadata goes to the device in one copy).
        Returns the last row of each request: (logits [bs, draft_vocab] float32, hidden [bs,
        draft_hidden])."""
        dev = self.device
        positions, starts = positions_and_starts(prefix_lens, extend_lens)  # numpy
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        last = starts + np.asarray(extend_lens, dtype=np.int64) - 1
        loc_on_host = out_cache_loc.device.type == "cpu"
        parts = [positions, starts, last, req_pool_indices, seq_lens, extend_lens, prefix_lens]
        moved = int64_to_device(parts + ([out_cache_loc] if loc_on_host else []), dev)
        positions, starts, last, pools, seq_t, ext_t, pre_t = moved[:7]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND,
            batch_size=len(extend_lens),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=moved[7] if loc_on_host else out_cache_loc.to(dev, torch.int64),
            req_pool_indices=pools,
            seq_lens=seq_t,
            extend_seq_lens=ext_t,
            extend_prefix_lens=pre_t,
            extend_start_loc=starts,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            logits_indices=last,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(fb)
        out = self.model.forward(input_ids, positions, fb, hidden_states)
        return out.logits, out.hidden_states
