"""CUDA graphs for the EAGLE-3 draft's forwards in decode steps.

DraftExtendGraphRunner: the catch-up draft extend that starts every drafting step. Request i
feeds c_i tokens (1 + the drafts it accepted last step, in steady drafting: at most K + 1) with
the target's aux hidden states [c_i, 3H]; ragged, like the target's verify, so it is captured
per (bs bucket, token bucket) the same way. Only the last row of each request is read, so the
graphs compute the lm_head for those rows alone. Longer catch-ups (after steps without
drafting) run eagerly.

DraftDecodeGraphRunner: every further draft step (chain drafting, steps 2..d) feeds each
drafting request one token and the draft's own hidden state from the step before.

Both are one small layer plus the draft lm_head, dominated by launch overhead when eager. They
reuse the target runner's machinery (CudaGraphRunner: padding to the bucket, one packed
host-to-device copy of the index inputs); the token ids and hidden states, which live on the
device, are copied into the static buffers on the stream after that copy, so no host
synchronisation is needed for them. The two runners share the draft's attention backend (its
CUDA-graph buffers and wrappers; one graph replays at a time and re-plans first).
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, as_int64
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
        """One draft step for m rows (can_run_decode(m) must hold). Returns (logits [m,
        draft_vocab] float32, hidden [m, draft hidden]) as views of the graph's outputs, valid
        until this runner's next replay: the chain drafting of EAGLEWorkerV2.draft_tokens picks
        its tokens from them and gathers the next step's inputs on the current stream before
        it replays again (copies would cost two more device calls per draft step)."""
        m = len(positions)
        key = self.pick(m, m)
        fb = self._fill(
            key,
            req_pool_indices,
            [p + 1 for p in positions],
            [1] * m,
            as_int64(input_ids),  # device ids: copied after the packed upload
            as_int64(out_cache_loc),
        )
        self.hidden[:m].copy_(hidden, non_blocking=True)
        out = self._execute(key, fb)
        return out.logits[:m], out.hidden_states[:m]


class DraftExtendGraphRunner(CudaGraphRunner):
    """Args: draft_runner (a DraftRunner holding an EAGLE-3 draft), batch_sizes (bs buckets),
    max_extend_len (longest catch-up captured: K + 1), use_graphs (False: run the padded
    static batch eagerly, for CPU tests). Capture it before the DraftDecodeGraphRunner of the
    same draft (it sizes the shared attention buffers for its larger token count)."""

    def __init__(
        self, draft_runner, batch_sizes: list[int], max_extend_len: int, use_graphs: bool = True
    ) -> None:
        model = draft_runner.model
        # [max_tokens, 3 * target hidden] model dtype: the catch-up rows' target aux states
        self.hidden = torch.zeros(
            batch_sizes[-1] * max_extend_len,
            3 * model.target_hidden_size,
            dtype=draft_runner.dtype,
            device=draft_runner.device,
        )
        super().__init__(
            draft_runner, CaptureHiddenMode.NULL, max_extend_len, batch_sizes, use_graphs
        )

    def _run_model(self, fb: ForwardBatch):
        # The last row of each request (pad requests: their one row), computed from the static
        # inputs inside the graph: logits and hidden states are taken at those rows only.
        fb.logits_indices = fb.extend_start_loc + fb.extend_seq_lens - 1  # [bs] int64
        return self.model.forward(fb.input_ids, fb.positions, fb, self.hidden[: fb.num_tokens])

    def extend(
        self,
        input_ids: torch.Tensor,  # [T] int64 (device)
        hidden: torch.Tensor,  # [T, 3 * target hidden]: the target's aux states of the rows
        req_pool_indices: list[int],  # [bs]
        prefix_lens: list[int],  # [bs] draft positions before this call's tokens
        extend_lens: list[int],  # [bs] tokens per request (fits(extend_lens) must hold)
        out_cache_loc: torch.Tensor,  # [T] int64 KV slots (CPU)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up draft extend through its graph. Returns each request's last row
        (logits [bs, draft_vocab] float32, hidden [bs, draft hidden]), as DraftRunner.forward
        does, but as views of the graph's outputs, valid until this runner's next replay (the
        drafting step consumes them before: see DraftDecodeGraphRunner.decode)."""
        bs, t = len(extend_lens), int(input_ids.numel())
        key = self.pick(bs, t)
        fb = self._fill(
            key,
            req_pool_indices,
            [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
            extend_lens,
            as_int64(input_ids),  # device ids: copied after the packed upload
            as_int64(out_cache_loc),
        )
        self.hidden[:t].copy_(hidden, non_blocking=True)
        out = self._execute(key, fb)
        return out.logits[:bs], out.hidden_states[:bs]
