"""CUDA graphs for the EAGLE-3 draft's single-token steps (chain drafting, steps 2..d).

After the catch-up draft extend (ragged, eager), every further draft step feeds each drafting
request one token and the draft's own hidden state from the step before: a decode-shaped
forward of one small layer plus the draft lm_head, dominated by launch overhead when eager.
This runner captures it per bs bucket with the target runner's machinery (CudaGraphRunner:
padding to the bucket, one packed host-to-device copy of the index inputs); the token ids and
hidden states, which live on the device, are copied into the static buffers on the stream after
that copy, so no host synchronisation is needed for them.
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch


class DraftDecodeGraphRunner(CudaGraphRunner):
    """Args: draft_runner (a DraftRunner holding an EAGLE-3 draft), batch_sizes (bs buckets),
    use_graphs (False: run the padded static batch eagerly, for CPU tests)."""

    def __init__(self, draft_runner, batch_sizes: list[int], use_graphs: bool = True) -> None:
        cfg = draft_runner.model.config
        # [max_bs, draft hidden] model dtype: input hidden state of each row (static buffer)
        self.hidden = torch.zeros(
            batch_sizes[-1], cfg.hidden_size, dtype=draft_runner.dtype, device=draft_runner.device
        )
        super().__init__(draft_runner, CaptureHiddenMode.NULL, 1, batch_sizes, use_graphs)

    def _run_model(self, fb: ForwardBatch):
        return self.model.forward(fb.input_ids, fb.positions, fb, self.hidden[: fb.batch_size])

    def can_run_decode(self, m: int) -> bool:
        return 0 < m <= self.max_bs

    def decode(
        self,
        input_ids: torch.Tensor,  # [m] int64 (device): the previous draft token of each row
        hidden: torch.Tensor,  # [m, draft hidden]: the previous step's pre-norm hidden
        req_pool_indices: list[int],  # [m]
        positions: list[int],  # [m] position of this step's token (= KV length before it)
        out_cache_loc: torch.Tensor,  # [m] int64 KV slots (CPU)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for m rows (can_run_decode(m) must hold). Returns fresh tensors
        (logits [m, draft_vocab] float32, hidden [m, draft hidden])."""
        m = len(positions)
        key = self.pick(m, m)
        fb = self._fill(
            key,
            req_pool_indices,
            [p + 1 for p in positions],
            [1] * m,
            input_ids.to(torch.int64),  # device ids: copied after the packed upload
            out_cache_loc.to(torch.int64),
        )
        self.hidden[:m].copy_(hidden, non_blocking=True)
        out = self._execute(key, fb)
        return out.logits[:m].clone(), out.hidden_states[:m].clone()
