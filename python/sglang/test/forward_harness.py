"""ForwardHarness: the smallest runner that drives a model over the real pools, for tests.

It owns a ReqToTokenPool, an MHATokenToKVPool, a TokenToKVPoolAllocator and an attention
backend (torch_native unless told otherwise), remembers each request's KV length, and builds
ragged extend ForwardBatches by hand, the way the scheduler + ModelRunner would.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    build_positions_and_starts,
)


class ForwardHarness:
    """Runs `model` step by step; requests are request-pool slots returned by new_request()."""

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        max_total_tokens: int = 4096,
        max_requests: int = 8,
        device: str = "cpu",
        attention_backend: str = "torch_native",
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.req_to_token_pool = ReqToTokenPool(max_requests, model_config.context_len, device)
        self.token_to_kv_pool = MHATokenToKVPool(
            max_total_tokens,
            model_config.dtype,
            model_config.get_num_kv_heads(1),
            model_config.head_dim,
            model_config.num_hidden_layers,
            device,
        )
        self.allocator = TokenToKVPoolAllocator(max_total_tokens)
        # create_attention_backend reads the runner's device (triton/flashinfer check it)
        self.attn_backend = create_attention_backend(attention_backend, self)
        self.kv_lens: dict[int, int] = {}  # request slot -> tokens with KV in the pool

    def new_request(self) -> int:
        """Take a request slot (its KV starts empty)."""
        slots = self.req_to_token_pool.alloc(1)
        if slots is None:
            raise RuntimeError("no free request slot")
        self.kv_lens[slots[0]] = 0
        return slots[0]

    def build_batch(
        self,
        reqs: list[tuple[int, list[int]]],
        all_logits: bool = False,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
        forward_mode: ForwardMode = ForwardMode.EXTEND,
    ) -> ForwardBatch:
        """ForwardBatch that appends token ids `reqs[i][1]` to request slot `reqs[i][0]`.

        Allocates their KV slots and writes req_to_token. Logit rows: each request's last token,
        or every token with all_logits.
        """
        slots = [slot for slot, _ in reqs]
        prefix = [self.kv_lens[slot] for slot in slots]
        ext = [len(ids) for _, ids in reqs]
        total = sum(ext)
        locs = self.allocator.alloc(total)
        if locs is None:
            raise RuntimeError("KV pool is full")
        start = 0
        for slot, pre, n in zip(slots, prefix, ext, strict=True):
            self.req_to_token_pool.write(slot, pre, locs[start : start + n])
            self.kv_lens[slot] = pre + n
            start += n
        positions, starts = build_positions_and_starts(prefix, ext, self.device)
        ext_t = torch.tensor(ext, dtype=torch.int64, device=self.device)
        seq = [p + n for p, n in zip(prefix, ext, strict=True)]
        if all_logits:
            logits_indices = torch.arange(total, dtype=torch.int64, device=self.device)
        else:
            logits_indices = starts + ext_t - 1
        ids = [t for _, tokens in reqs for t in tokens]
        return ForwardBatch(
            forward_mode=forward_mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=positions,
            out_cache_loc=locs.to(self.device),
            req_pool_indices=torch.tensor(slots, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=self.device),
            extend_seq_lens=ext_t,
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int64, device=self.device),
            extend_start_loc=starts,
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext,
            extend_prefix_lens_cpu=prefix,
            logits_indices=logits_indices,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            capture_hidden_mode=capture_hidden_mode,
        )

    @torch.no_grad()
    def forward(self, reqs: list[tuple[int, list[int]]], **kw) -> LogitsProcessorOutput:
        """Build the batch (see build_batch for kwargs) and run the model on it."""
        batch = self.build_batch(reqs, **kw)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)
