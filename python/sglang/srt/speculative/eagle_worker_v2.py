"""EAGLEWorkerV2: executes the scheduler's speculative plan (chain drafts, topk = 1).

Stateless with respect to the batch: a ModelWorkerBatch (with its SpecPlan) comes in; per-request
accepted tokens, accept lengths and target logprobs go out; the target hidden states the draft
reads later go into the hidden state pool by KV slot, with the target forward. It never
allocates or frees KV and never writes req_to_token: every slot it writes (draft KV of catch-up
positions, of draft steps, target KV and hidden states of verify tokens) was assigned by the
scheduler. Requests with d_i = 0 are plain decode rows of the same verify forward.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import accumulate

import numpy as np
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import Sampler, compute_logprobs, sampling_probs
from sglang.srt.managers.pending_result import PendingResult, begin_step
from sglang.srt.managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch
from sglang.srt.managers.tp_worker import TpModelWorker, ids_by_request
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sglang.srt.sampling.random import (
    STREAM_DRAFT,
    STREAM_SAMPLE,
    STREAM_SPEC_ACCEPT,
    sample_from_probs,
    uniform_noise,
)
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_config import (
    aux_layer_ids,
    check_draft_algorithm,
    read_draft_config,
)
from sglang.srt.speculative.draft_cuda_graph_runner import CHAIN_MAX_BS, chain_graphs_enabled
from sglang.srt.speculative.draft_runner import DraftRunner
from sglang.srt.speculative.spec_info import SpecStepOutput
from sglang.srt.speculative.verify import (
    greedy_fused_applies,
    greedy_rows,
    packed_result,
    speculative_sample,
    verify_greedy_rows,
)
from sglang.srt.utils.h2d import int64_to_device


def token_starts(mwb: ModelWorkerBatch) -> list[int]:
    """[bs] index of each request's first token in the step's token stream (host lists)."""
    return list(accumulate([0, *mwb.extend_seq_lens[:-1]]))


def drafts_by_request(drafts: torch.Tensor, draft_lens: list[int]) -> list[list[int]]:
    """[sum d_i] request-major draft ids (device or host) -> per request lists of d_i ids (one
    read-back)."""
    it = iter(drafts.tolist())
    return [[next(it) for _ in range(n)] for n in draft_lens]


def plain_decode_output(
    ids: list[int], logprobs: list[float] | None = None, top_logprobs: list | None = None
) -> SpecStepOutput:
    """The SpecStepOutput of a step where every d_i = 0: request i commits ids[i] (no draft
    accepted; its hidden state went to the pool with the forward)."""
    return SpecStepOutput(
        tokens=[[t] for t in ids],
        num_accepted=[0] * len(ids),
        logprobs=[[lp] for lp in logprobs] if logprobs is not None else None,
        top_logprobs=[[t] for t in top_logprobs] if logprobs is not None else None,
    )


class EAGLEWorkerV2:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs) -> None:
        self.target_worker = TpModelWorker(model_config, server_args, init_cuda_graphs=False)
        self.model_runner = self.target_worker.model_runner
        self.device = self.target_worker.device
        self.vocab_size = model_config.vocab_size
        draft_path = server_args.speculative_draft_model_path
        # --speculative-algorithm must match the checkpoint (ValueError before loading the draft)
        check_draft_algorithm(read_draft_config(draft_path), server_args.speculative_algorithm)
        self.draft = DraftRunner(draft_path, self.model_runner)
        if isinstance(self.draft.model, LlamaForCausalLMEagle3):
            layers = aux_layer_ids(self.draft.model.config, model_config.num_hidden_layers)
            self.model_runner.model.set_eagle3_layers_to_capture(layers)
        # EAGLE (v1) drafts read the target's final hidden states: no aux capture.
        # Target graphs: decode (all d_i = 0) and verify (up to K + 1 tokens per request), both
        # writing the hidden states of every row into the hidden state pool for the draft.
        self.hidden_pool = self.model_runner.hidden_pool
        self.model_runner.init_cuda_graphs(
            CaptureHiddenMode.LAST, server_args.speculative_num_steps + 1
        )
        target_graphs = self.model_runner.cuda_graph_runner
        if target_graphs is not None:  # same bs buckets for the draft's single-token steps
            self.draft.init_cuda_graphs(
                target_graphs.batch_sizes, server_args.speculative_num_steps + 1
            )
            if chain_graphs_enabled():  # whole greedy drafting steps, small batches
                sizes = [b for b in target_graphs.batch_sizes if b <= CHAIN_MAX_BS]
                self.draft.init_chain_graphs(
                    self.hidden_pool, sizes, server_args.speculative_num_steps
                )
        # --speculative-coupled-sampling: drafts and verification of sampled requests use
        # the plain sampler's noise (STREAM_SAMPLE at each output position), see forward_verify
        self.coupled = server_args.speculative_coupled_sampling
        vd = self.draft.model.config.draft_vocab_size or self.vocab_size
        self.draft_to_target = self.draft.model.map_to_target(
            torch.arange(vd, device=self.device)
        )  # [draft_vocab] int64

    @property
    def pools(self) -> tuple:
        return self.target_worker.pools

    @torch.no_grad()
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        t0 = time.perf_counter()
        if mwb.forward_mode == ForwardMode.EXTEND:
            result = self.forward_extend(mwb)
        elif sum(mwb.spec.draft_lens) == 0:
            result = self.forward_plain_decode(mwb)
        else:
            result = self.forward_verify(mwb)
        self.target_worker.synchronize()
        result.forward_time_s = time.perf_counter() - t0
        return result

    @torch.no_grad()
    def forward_batch_generation_launch(self, mwb: ModelWorkerBatch) -> PendingResult:
        """Queue a step without waiting for the device when it is a prefill, or a decode step
        where every d_i is 0, and no logprobs are asked (the steps overlap scheduling
        pipelines; see pending_result.py); other steps run synchronously and come back
        finished."""
        if mwb.forward_mode == ForwardMode.EXTEND and not mwb.return_logprob:
            return self._launch_extend(mwb)
        plain = mwb.forward_mode != ForwardMode.EXTEND and sum(mwb.spec.draft_lens) == 0
        if not plain or mwb.return_logprob or not all(mwb.sample):
            return PendingResult.done(self.forward_batch_generation(mwb))
        began = begin_step(self.device, timed=mwb.spec.time_forward)
        out = self.model_runner.forward_worker_batch(
            mwb, capture_hidden_mode=CaptureHiddenMode.LAST
        )
        rows, ids = self.target_worker.sample_launch(mwb, out.next_token_logits)

        def to_result(host_ids: list[int]) -> GenerationBatchResult:
            return GenerationBatchResult(  # every row of a decode step samples
                next_token_ids=host_ids, spec=plain_decode_output(host_ids)
            )

        return PendingResult.from_device_ids(rows, ids, to_result, began)

    # ---------------------------------------------------------------- prefill
    def forward_extend(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Target prefill (its hidden states into the pool) + draft extend over the chunk."""
        out = self._extend(mwb)
        result = self.target_worker.sample(mwb, out.next_token_logits)
        result.draft_keep_rows = mwb.spec.draft_keep_rows or None
        return result

    def _launch_extend(self, mwb: ModelWorkerBatch) -> PendingResult:
        """forward_extend queued without waiting for the device: the sampled ids come back
        through PendingResult, like a plain prefill (sampling is seeded per request and
        position, so sampling after the draft extend samples the same tokens). Untimed, as a
        plain server's prefill: only decode steps' device times are read (the policy's)."""
        began = begin_step(self.device, timed=False)
        out = self._extend(mwb)
        rows, ids = self.target_worker.sample_launch(mwb, out.next_token_logits)
        bs = mwb.batch_size
        keep = mwb.spec.draft_keep_rows or None

        def to_result(host_ids: list[int]) -> GenerationBatchResult:
            result = GenerationBatchResult(next_token_ids=ids_by_request(bs, rows, host_ids))
            result.draft_keep_rows = keep
            return result

        return PendingResult.from_device_ids(rows, ids, to_result, began)

    def _extend(self, mwb: ModelWorkerBatch) -> LogitsProcessorOutput:
        """Queue the target prefill (every row's hidden states, [T, 3H], which also go to the
        hidden state pool) and the draft extend over each chunk's first e_i positions; no
        host synchronisation. Returns the target output."""
        # a prefill graph when one holds it (--cuda-graph-prefill-max-tokens), else eager
        full = CaptureHiddenMode.FULL
        out = self.model_runner.forward_worker_batch(mwb, capture_hidden_mode=full)
        hidden = out.hidden_states  # [T, 3H]
        starts = token_starts(mwb)
        rows, ids, slots, reqs, prefix, lens = [], [], [], [], [], []
        for i, ext_ids in enumerate(mwb.spec.draft_extend_ids):
            if not ext_ids:
                continue
            e = len(ext_ids)
            rows.extend(range(starts[i], starts[i] + e))
            ids.extend(ext_ids)
            slots.append(mwb.out_cache_loc[starts[i] : starts[i] + e])
            reqs.append(mwb.req_pool_indices[i])
            prefix.append(mwb.extend_prefix_lens[i])
            lens.append(e)
        if reqs:
            ids_t, rows_t = int64_to_device([ids, rows], self.device)
            self.draft.forward(ids_t, hidden[rows_t], reqs, prefix, lens, torch.cat(slots))
        return out

    # ---------------------------------------------------------------- d_i = 0 for all
    def forward_plain_decode(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Every d_i is 0: one target decode token per request, exactly a non-speculative step
        (plus each row's hidden state into the pool, for when drafting resumes)."""
        out = self.model_runner.forward_worker_batch(
            mwb, capture_hidden_mode=CaptureHiddenMode.LAST
        )
        result = self.target_worker.sample(mwb, out.next_token_logits)
        result.spec = plain_decode_output(
            result.next_token_ids, result.next_token_logprobs, result.next_top_logprobs
        )
        return result

    # ---------------------------------------------------------------- draft + verify
    def draft_tokens(self, mwb: ModelWorkerBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chain drafting: catch-up draft extend, then d_i - 1 single-token draft steps, only
        for requests with d_i > 0. Everything stays on the device (no host synchronisation).
        Returns (drafts [sum d_i] int64 target ids on the device, request i's d_i drafts
        contiguous, requests in order; q [sum d_i, V] float32 in the same order, or None when
        every request is greedy)."""
        plan, info = mwb.spec, mwb.sampling_info
        d = plan.draft_lens
        active = [i for i in range(len(d)) if d[i] > 0]
        starts = token_starts(mwb)
        loc = mwb.out_cache_loc.numpy()  # [R] KV slots of the verify rows (CPU)
        # the catch-up draft extend of the drafting requests (both paths below)
        ids = [t for i in active for t in plan.catchup_ids[i]]
        slots = np.concatenate([plan.catchup_slots[i] for i in active])
        pools = [mwb.req_pool_indices[i] for i in active]
        prefix = [plan.catchup_prefix_lens[i] for i in active]
        lens = [len(plan.catchup_ids[i]) for i in active]
        chain = self.draft.chain_graph_runner
        if chain is not None and info.is_all_greedy and chain.fits_chain(lens):
            drafts = chain.draft(
                ids,
                slots,
                pools,
                prefix,
                lens,
                [d[i] for i in active],
                [mwb.extend_prefix_lens[i] for i in active],
                [loc[starts[i] : starts[i] + d[i]] for i in active],
            )
            return drafts, None
        q_rows: list[list[torch.Tensor]] = [[] for _ in d]
        # Draft step s proposes token s - 1 of every request with d_i >= s; `order` maps the
        # step-major proposals to the request-major output (known before drafting).
        first = list(accumulate([0, *d[:-1]]))
        order = [first[i] + s for s in range(max(d)) for i in active if d[i] > s]
        catchup_ids, order_t, slots_t = int64_to_device([ids, order, slots], self.device)
        logits, g = self.draft.catch_up(
            catchup_ids,
            self.hidden_pool.read(slots_t),  # the pending positions' target hidden states
            pools,
            prefix,
            lens,
            torch.from_numpy(slots),
        )
        step = 1
        picked: list[torch.Tensor] = []  # per draft step: [m] target ids of its active rows
        while True:
            tok = self._pick(logits, active, step, info, q_rows)  # [m] int64, on the device
            picked.append(tok)
            step += 1
            keep = [k for k, i in enumerate(active) if d[i] >= step]
            if not keep:
                break
            if len(keep) < len(active):  # some requests stop drafting: gather the rest
                active = [active[k] for k in keep]
                (keep_t,) = int64_to_device([keep], self.device)
                tok, g = tok[keep_t], g[keep_t]
            # Draft step `step` sits at position n_i + step - 2, in the KV slot of verify token
            # step - 2 (the scheduler wrote those slots into req_to_token).
            pos = [mwb.extend_prefix_lens[i] + step - 2 for i in active]
            logits, g = self.draft.decode(
                tok,
                g,
                [mwb.req_pool_indices[i] for i in active],
                pos,
                torch.from_numpy(loc[[starts[i] + step - 2 for i in active]]),  # numpy gather
            )
        flat = picked[0]  # one draft step: step-major is request-major
        if len(picked) > 1:
            step_major = torch.cat(picked)
            flat = torch.empty_like(step_major).index_copy_(0, order_t, step_major)
        flat_q = [q for i in range(len(d)) for q in q_rows[i]]
        return flat, torch.stack(flat_q) if flat_q else None

    def _pick(self, logits, active, step, info, q_rows) -> torch.Tensor:
        """Choose each active request's draft token `step` ([m] int64 target ids, device) and
        record its draft distribution q over the target vocabulary (one-hot for greedy rows;
        nothing when every request is greedy: greedy verification never reads q).

        Every request greedy: the token is the argmax, what sampling from the one-hot q below
        returns, without the softmax, the one-hot and the per-row noise of the sampler (tens
        of small kernels per draft step)."""
        if info.is_all_greedy:
            return self.draft_to_target[logits.argmax(-1)]
        (idx,) = int64_to_device([active], self.device)
        greedy = info.greedy_mask[idx]
        temps = info.temperatures[idx]
        q_draft = torch.softmax(logits / temps, dim=-1)  # [m, Vd]
        hot = torch.zeros_like(q_draft).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        q_draft = torch.where(greedy.view(-1, 1), hot, q_draft)
        pos = info.random_positions[idx] + (step - 1)  # the output index it would take
        q = torch.zeros(len(active), self.vocab_size, device=self.device)
        q.index_copy_(1, self.draft_to_target, q_draft)
        for k, i in enumerate(active):
            q_rows[i].append(q[k])
        if self.coupled:
            # the target's race: over target ids (a column's noise is keyed by its index, and
            # with a draft vocabulary draft id j is target id draft_to_target[j])
            return sample_from_probs(q, info.seeds[idx], pos, STREAM_SAMPLE)
        tok = sample_from_probs(q_draft, info.seeds[idx], pos, STREAM_DRAFT)
        return self.draft_to_target[tok]

    def forward_verify(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        """Draft, verify and accept with one host synchronisation, at the end (the drafts go
        from the draft model into the verify input on the device; the host reads them back
        only when a penalty needs them)."""
        plan, info = mwb.spec, mwb.sampling_info
        d = plan.draft_lens
        drafts, q = self.draft_tokens(mwb)  # [sum d_i] int64 device, request-major
        # Target verify: one ragged extend of sum(1 + d_i) tokens [x_n, d_1 .. d_{d_i}].
        starts = token_starts(mwb)
        rows = [starts[i] + 1 + j for i in range(len(d)) for j in range(d[i])]
        # greedy verification: the fused kernel reads each request's first row and d_i; the
        # torch path reads gather lists built here
        fused = info.is_all_greedy and greedy_fused_applies(self.device)
        if not (info.is_all_greedy or self.coupled):  # coupled: greedy against sampled ids
            greedy = ()
        else:
            greedy = ([*starts],) if fused else greedy_rows(d)
        ids, rows_t, d_t, *lay = int64_to_device([mwb.input_ids, rows, d, *greedy], self.device)
        ids = ids.index_put((rows_t,), drafts)  # [R] int64: the verify input
        out = self.model_runner.forward_worker_batch(
            dataclasses.replace(mwb, input_ids=ids),
            forward_mode=ForwardMode.TARGET_VERIFY,
            capture_hidden_mode=CaptureHiddenMode.LAST,
        )
        logits = out.next_token_logits  # [R, V] (the [R, 3H] hidden states went to the pool)

        if info.is_all_greedy and not info.has_logits_processors:
            return self._collect(
                mwb, logits, self._verify_greedy(logits.argmax(-1), ids, d_t, lay, d, fused), starts
            )
        host_drafts = None
        if info.reads_output_ids:  # penalties count the drafts: they must come to the host
            host_drafts = drafts_by_request(drafts, d)
        rows_info = info.expand([1 + x for x in d], host_drafts)
        processed = rows_info.apply_logits_processors(logits)
        if info.is_all_greedy:
            both = self._verify_greedy(processed.argmax(-1), ids, d_t, lay, d, fused)
        elif self.coupled:
            # Coupled verification: each row's token is what the plain sampler draws at that
            # output position (rows_info: the drafts before it count as generated), and a
            # draft is accepted only when it is that token, so the committed text is plain
            # sampling's whatever the draft lengths were. Greedy verification against those
            # tokens does exactly this (greedy rows: their argmax, as in the plain sampler).
            picked = Sampler._sample(processed, rows_info)  # [R] int64
            both = self._verify_greedy(picked, ids, d_t, lay, d, fused)
        else:
            p = sampling_probs(processed, rows_info)
            u = uniform_noise(rows_info.seeds, rows_info.random_positions, 1, STREAM_SPEC_ACCEPT)

            def sample_fn(probs: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
                return sample_from_probs(
                    probs, info.seeds, info.random_positions + steps, STREAM_SAMPLE
                )

            vo = speculative_sample(drafts, d_t, q, p, u[:, 0], sample_fn, host_lens=d)
            both = packed_result(vo)
        return self._collect(mwb, logits, both, starts)

    @staticmethod
    def _verify_greedy(target, ids, d_t, lay, d: list[int], fused: bool) -> torch.Tensor:
        """Greedy verification against the step's [R] int64 target ids (each row's argmax, or
        with coupled sampling the plain sampler's draw): [bs, 1 + max d + 1] int64 (accept
        lengths, output ids). lay: what int64_to_device moved for it (fused: each request's
        first verify row; else greedy_rows' three lists)."""
        if fused:  # imports triton: only on this path
            from sglang.srt.layers.triton_kernels.verify import verify_greedy_fused

            return verify_greedy_fused(target, ids, lay[0], d_t, max(d) + 1)
        return packed_result(verify_greedy_rows(target, ids, *lay, max(d) + 1))

    def _collect(self, mwb, logits, both, starts) -> GenerationBatchResult:
        """both: [bs, 1 + max_d + 1] int64 device (num_accepted, output ids), read back in one
        copy."""
        both = both.tolist()
        acc = [r[0] for r in both]
        tokens = [r[1 : 2 + a] for r, a in zip(both, acc, strict=True)]
        spec = SpecStepOutput(tokens=tokens, num_accepted=acc, logprobs=None, top_logprobs=None)
        if mwb.return_logprob:
            rows = torch.tensor(
                [starts[i] + j for i in range(len(acc)) for j in range(acc[i] + 1)],
                device=self.device,
            )
            ids = torch.tensor([t for ts in tokens for t in ts], device=self.device)
            nums = [mwb.top_logprobs_nums[i] for i in range(len(acc)) for _ in range(acc[i] + 1)]
            chosen, top = compute_logprobs(logits[rows], ids, nums if any(nums) else None)
            chosen = chosen.tolist()
            spec.logprobs, spec.top_logprobs, k = [], [], 0
            for ts in tokens:
                spec.logprobs.append(chosen[k : k + len(ts)])
                tops = top[k : k + len(ts)] if top is not None else [([], [])] * len(ts)
                spec.top_logprobs.append([list(zip(v, t, strict=True)) for v, t in tops])
                k += len(ts)
        return GenerationBatchResult(next_token_ids=[ts[-1] for ts in tokens], spec=spec)
