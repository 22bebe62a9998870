"""LogitsProcessor: final hidden states -> next-token logits at the requested rows, plus the
hidden states speculative decoding asks for (upstream names and roles)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.layers.triton_kernels import use_triton_gemv
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch


@dataclass
class LogitsProcessorOutput:
    # [num_rows, vocab] float32, one row per forward_batch.logits_indices entry
    next_token_logits: torch.Tensor
    # None, or [num_tokens | num_rows, H'] in the model dtype (see LogitsProcessor.forward)
    hidden_states: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    """Computes logits = hidden[logits_indices] @ lm_head.weight^T (+ bias) in the model dtype and
    returns them as float32, cut to config.vocab_size (vocabulary padding removed)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H] model dtype, after the final norm
        lm_head: nn.Module,
        forward_batch: ForwardBatch,
        aux_hidden_states: list[torch.Tensor] | None = None,  # each [T, H], EAGLE-3 capture
    ) -> LogitsProcessorOutput:
        """Returns next_token_logits [len(logits_indices), vocab] float32 and hidden_states:
        None when capture_hidden_mode is NULL; else the captured states (the concatenation of
        `aux_hidden_states` [.., 3H] when given, otherwise `hidden_states` [.., H]) for all T
        tokens (FULL) or only the logits rows (LAST)."""
        rows = forward_batch.logits_indices
        # Logits rows are ascending and distinct (each request's last rows), so as many rows
        # as tokens means every token (decode, verify): no gather (a kernel per step, also
        # inside a CUDA graph, whose decode and verify buckets keep rows = arange(T)).
        every_row = rows.shape[0] == hidden_states.shape[0]
        pruned = hidden_states if every_row else hidden_states[rows]  # [num_rows, H]
        logits = self._compute_logits(pruned, lm_head)

        captured = None
        mode = forward_batch.capture_hidden_mode
        if mode != CaptureHiddenMode.NULL:
            source = torch.cat(aux_hidden_states, dim=-1) if aux_hidden_states else hidden_states
            full = mode == CaptureHiddenMode.FULL or every_row
            captured = source if full else source[rows]
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=captured)

    def _compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        weight = lm_head.weight  # [V / tp, H]
        if use_triton_gemv(hidden, weight):  # CUDA, up to SGLANG_TRITON_GEMV_MAX_ROWS rows
            from sglang.srt.layers.triton_kernels.gemv import gemv

            logits = gemv(hidden, weight)
        else:
            logits = torch.matmul(hidden, weight.t())  # [rows, V / tp] model dtype
        bias = getattr(lm_head, "bias", None)
        if bias is not None:
            logits = logits + bias
        tp_size = getattr(lm_head, "tp_size", 1)
        if tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(tp_size)]
            torch.distributed.all_gather(parts, logits.contiguous())
            logits = torch.cat(parts, dim=-1)
        logits = logits[:, : self.vocab_size].float()
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
