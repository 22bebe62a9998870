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

import numpy as np
import torch

from sglang.srt.model_executor.cuda_graph_inputs import PinnedStaging
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, as_int64
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.server_args import env_flag

# Largest bs bucket with whole-chain drafting graphs: beyond it drafting rarely pays (the
# adaptive policy turns it off under load) and the step-by-step replays' host cost is spread
# over many requests.
CHAIN_MAX_BS = 32


def chain_graphs_enabled() -> bool:
    """Whole-chain drafting graphs are on unless SGLANG_DRAFT_CHAIN_GRAPHS=0 (A/B runs)."""
    return env_flag("DRAFT_CHAIN_GRAPHS", "1") != "0"


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

    multi_token_mode = ForwardMode.DRAFT_EXTEND  # its multi-token keys are catch-ups

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


class DraftChainGraphRunner(CudaGraphRunner):
    """A whole greedy chain drafting step in one CUDA graph: the catch-up draft extend, its
    argmax, then K - 1 single-token draft steps, each feeding the previous step's argmax and
    pre-norm hidden state (EAGLEWorkerV2.draft_tokens' chain, for all-greedy batches).

    Why: replayed step by step, a drafting step costs K graph replays, each with its own
    packed upload, attention planning and argmax launches; at batch 1 on the H200 that host
    work (about 1 ms at K = 3) exceeds the draft's device time several times over. Here one
    packed upload and one replay cover the chain (upstream SGLang captures its multi-step
    draft loop the same way).

    The graphs run the draft's attention through our Triton backend (its own instance):
    its kernels read seq_lens and req_to_token on the device, so every draft step's
    metadata is computed inside the graph, where FlashInfer would need a host plan per step.

    One graph per bs bucket b (no larger than CHAIN_MAX_BS), of b * (K + 1) catch-up tokens
    (full_token_buckets_only). Rows stop drafting at their own d_i <= K: from step d_i + 1 on,
    a row stays at its last position (in range of its req_to_token row) and writes its draft
    K/V to the padding slot 0, so no slot it does not own is written; its later tokens are
    never read.

    Args: draft_runner (a DraftRunner holding an EAGLE-3 draft), hidden_pool (the target's
    HiddenStatePool: the catch-up rows' aux states are gathered from it inside the graph),
    batch_sizes (bs buckets), num_steps (K), use_graphs (False: run the padded static batch
    eagerly, for CPU tests; the Triton backend then needs TRITON_INTERPRET=1).
    """

    multi_token_mode = ForwardMode.DRAFT_EXTEND  # its multi-token keys are catch-ups

    def __init__(
        self,
        draft_runner,
        hidden_pool,
        batch_sizes: list[int],
        num_steps: int,
        use_graphs: bool = True,
    ) -> None:
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        self.K = num_steps
        self.hidden_pool = hidden_pool
        max_bs = batch_sizes[-1]
        n = max_bs * (num_steps + 1)
        # Packed int64 chain inputs, one upload per replay. Layout: step positions
        # [(K - 1) * B] | step seq_lens [(K - 1) * B] | step KV slots [(K - 1) * B] | catch-up
        # rows' hidden-pool slots [N] | request-major gather index into toks [B * K].
        size = 3 * (num_steps - 1) * max_bs + n + max_bs * num_steps
        self.chain = PinnedStaging(size, draft_runner.device)
        # [K, B] int64: token s of every row (target vocabulary), written by the graph
        self.toks = torch.zeros(num_steps, max_bs, dtype=torch.int64, device=draft_runner.device)
        self.steps: dict[int, list[ForwardBatch]] = {}  # per bs bucket: K - 1 decode batches
        super().__init__(
            draft_runner,
            CaptureHiddenMode.NULL,
            num_steps + 1,
            batch_sizes,
            use_graphs,
            backend=TritonAttnBackend(draft_runner),
            full_token_buckets_only=True,
        )

    def _chain_region(self, t: torch.Tensor, field: int, n: int | None = None) -> torch.Tensor:
        """Field 0..4 of the chain buffer t (positions, seq_lens, slots, hidden slots,
        gather), or of its host stage; fields 0..2 as [K - 1, B]."""
        B, N, K = self.max_bs, self.max_tokens, self.K
        step = (K - 1) * B
        if field < 3:
            return t[field * step : (field + 1) * step].reshape(K - 1, B)  # a view
        off = 3 * step + (0 if field == 3 else N)
        return t[off : off + (n if n is not None else (N if field == 3 else B * K))]

    def _step_batches(self, b: int) -> list[ForwardBatch]:
        """The K - 1 single-token draft batches of bucket b (static views into the chain
        buffer; metadata built once: Triton needs no per-replay planning)."""
        if b not in self.steps:
            dev = self.chain.dev
            arange = self.logits_indices[:b]
            batches = []
            for s in range(self.K - 1):
                pos = self._chain_region(dev, 0)[s, :b]
                fb = ForwardBatch(
                    forward_mode=ForwardMode.DECODE,
                    batch_size=b,
                    input_ids=self.toks[s, :b],
                    positions=pos,
                    out_cache_loc=self._chain_region(dev, 2)[s, :b],
                    req_pool_indices=self.inputs.region(self.inputs.dev, 0, b),
                    seq_lens=self._chain_region(dev, 1)[s, :b],
                    extend_seq_lens=torch.ones(b, dtype=torch.int64, device=dev.device),
                    extend_prefix_lens=pos,
                    extend_start_loc=arange,
                    seq_lens_cpu=[1] * b,
                    extend_seq_lens_cpu=[1] * b,
                    extend_prefix_lens_cpu=[0] * b,
                    logits_indices=arange,
                    req_to_token_pool=self.runner.req_to_token_pool,
                    token_to_kv_pool=self.runner.token_to_kv_pool,
                    attn_backend=self.backend,
                )
                self.backend.init_forward_metadata_capture_cuda_graph(fb, 1)
                batches.append(fb)
            self.steps[b] = batches
        return self.steps[b]

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        b, n = fb.batch_size, fb.num_tokens
        fb.logits_indices = fb.extend_start_loc + fb.extend_seq_lens - 1  # [b] last rows
        hidden = self.hidden_pool.buffer.index_select(0, self._chain_region(self.chain.dev, 3, n))
        out = self.model.forward(fb.input_ids, fb.positions, fb, hidden)
        for s, step in enumerate([None, *self._step_batches(b)]):
            if step is not None:
                out = self.model.forward(step.input_ids, step.positions, step, out.hidden_states)
            self.toks[s, :b].copy_(self.model.map_to_target(out.logits.argmax(-1)))
        return self.toks

    def _dummy_fill(self, key) -> ForwardBatch:
        h = self.chain.stage()
        h[:] = 0
        self._chain_region(h, 1)[:] = 1  # step seq_lens: one key each (position 0)
        self.chain.upload()
        return super()._dummy_fill(key)

    def fits_chain(self, extend_lens: list[int]) -> bool:
        """Whether a drafting step whose drafting requests catch up extend_lens[i] tokens
        (each >= 1) replays here: at most max_bs requests, none longer than K + 1."""
        return 0 < len(extend_lens) <= self.max_bs and max(extend_lens) <= self.max_extend_len

    def draft(
        self,
        catchup_ids: list[int],  # [T] target ids of the catch-up rows, request-major
        catchup_slots: np.ndarray,  # [T] int64 their KV slots (= their hidden-pool rows)
        req_pool_indices: list[int],  # [m]
        prefix_lens: list[int],  # [m] draft positions before the catch-up
        extend_lens: list[int],  # [m] catch-up tokens per request (fits_chain must hold)
        draft_lens: list[int],  # [m] d_i in [1, K]
        verify_prefix_lens: list[int],  # [m] n_i: position of the verify step's first token
        verify_slots: list[np.ndarray],  # [m] KV slots of request i's verify tokens (>= d_i)
    ) -> torch.Tensor:
        """Chain drafting of m requests: [sum d_i] int64 target ids on the device, request i's
        d_i drafts contiguous, requests in order (a fresh tensor). Draft step s >= 2 sits at
        position n_i + s - 2, in the KV slot of verify token s - 2 (the scheduler wrote those
        slots into req_to_token)."""
        m, t, K = len(extend_lens), len(catchup_ids), self.K
        key = self.pick(m, t)
        h = self.chain.stage()
        pos, seq, loc = (self._chain_region(h, f) for f in range(3))
        pos[:] = 0  # pad rows: position 0, slot 0
        loc[:] = 0
        gather = []
        rows = zip(draft_lens, verify_prefix_lens, verify_slots, strict=True)
        for i, (d, n, slots) in enumerate(rows):
            for s in range(2, K + 1):  # frozen at its last step once s > d (slot 0)
                pos[s - 2, i] = n + min(s, d) - 2
                if s <= d:
                    loc[s - 2, i] = slots[s - 2]
            gather.extend(j * self.max_bs + i for j in range(d))
        seq[:] = pos + 1  # each step's KV length: its token's position + 1
        hs = self._chain_region(h, 3)
        hs[:t] = catchup_slots
        hs[t:] = 0
        self._chain_region(h, 4, len(gather))[:] = gather
        self.chain.upload()
        fb = self._fill(
            key,
            req_pool_indices,
            [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
            extend_lens,
            torch.tensor(catchup_ids, dtype=torch.int64),
            torch.from_numpy(catchup_slots),
        )
        toks = self._execute(key, fb)
        return toks.view(-1).index_select(0, self._chain_region(self.chain.dev, 4, len(gather)))
