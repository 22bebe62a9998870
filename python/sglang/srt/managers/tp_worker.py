"""TpModelWorker: executes the scheduler's ModelWorkerBatch (forward + sampling + logprobs).

Stateless with respect to requests: ModelWorkerBatch in, GenerationBatchResult out.
"""

from __future__ import annotations

import time
from itertools import accumulate

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.sampler import Sampler
from sglang.srt.managers.pending_result import PendingResult, begin_step
from sglang.srt.managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs


def top_logprobs_of(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The k most likely tokens of one row of log-probabilities, as (logprob, token_id)."""
    if k <= 0:
        return []
    vals, ids = logprobs.topk(k)
    return list(zip(vals.tolist(), ids.tolist(), strict=True))


def sampled_logits(mwb: ModelWorkerBatch, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The requests that sample this step (sample[i]) and their last logits rows.

    logits: [num_logit_rows total, V]. Returns (rows [n] request indices, [n, V] logits; the
    input itself when every row samples, as in decode)."""
    rows = [i for i in range(mwb.batch_size) if mwb.sample[i]]
    if len(rows) == logits.shape[0]:
        return rows, logits
    row_end = list(accumulate(mwb.num_logit_rows))
    idx = torch.tensor([row_end[i] - 1 for i in rows], dtype=torch.int64, device=logits.device)
    return rows, logits[idx]


def ids_by_request(bs: int, rows: list[int], ids: list[int]) -> list[int | None]:
    """[bs] the sampled id of each request in rows (ids[k] for rows[k]), None for the others
    (prompt chunks that do not sample)."""
    out: list[int | None] = [None] * bs
    for i, t in zip(rows, ids, strict=True):
        out[i] = t
    return out


class TpModelWorker:
    """Args: init_cuda_graphs=False when a wrapping worker (EAGLE) captures the graphs itself
    after finishing the model's setup."""

    def __init__(
        self, model_config: ModelConfig, server_args: ServerArgs, init_cuda_graphs: bool = True
    ) -> None:
        self.model_config = model_config
        self.model_runner = ModelRunner(model_config, server_args)
        self.sampler = Sampler()
        self.device = self.model_runner.device
        if init_cuda_graphs:
            self.model_runner.init_cuda_graphs()

    @torch.no_grad()
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        t0 = time.perf_counter()
        logits = self.model_runner.forward_worker_batch(mwb).next_token_logits  # [rows, V] f32
        result = self.sample(mwb, logits)
        self.synchronize()
        result.forward_time_s = time.perf_counter() - t0
        return result

    @torch.no_grad()
    def forward_batch_generation_launch(self, mwb: ModelWorkerBatch) -> PendingResult:
        """Queue the step's forward and sampling without waiting for the device (see
        pending_result.py); finish() gives what forward_batch_generation returns. Steps that
        read logprobs back run synchronously (their host work needs the values)."""
        if mwb.return_logprob:
            return PendingResult.done(self.forward_batch_generation(mwb))
        began = begin_step(self.device, timed=False)  # nobody reads a plain step's device time
        logits = self.model_runner.forward_worker_batch(mwb).next_token_logits  # [rows, V] f32
        rows, ids = self.sample_launch(mwb, logits)
        bs = mwb.batch_size

        def to_result(host_ids: list[int]) -> GenerationBatchResult:
            return GenerationBatchResult(next_token_ids=ids_by_request(bs, rows, host_ids))

        return PendingResult.from_device_ids(rows, ids, to_result, began)

    def sample_launch(
        self, mwb: ModelWorkerBatch, logits: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """Queue sampling of every request with sample[i] (no logprobs). Returns (rows: the
        request indices that sample, ids: [len(rows)] int64 on the device)."""
        rows, picked = sampled_logits(mwb, logits)
        if not rows:
            return rows, torch.empty(0, dtype=torch.int64, device=logits.device)
        return rows, self.sampler(picked, mwb.sampling_info).next_token_ids

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sample(self, mwb: ModelWorkerBatch, logits: torch.Tensor) -> GenerationBatchResult:
        """Sample the last row of every request with sample[i]; score prompt-logprob rows."""
        bs = mwb.batch_size
        row_end = list(accumulate(mwb.num_logit_rows))
        sampled_idx, picked = sampled_logits(mwb, logits)
        next_ids: list[int | None] = [None] * bs
        next_lps: list[float | None] = [None] * bs
        next_tops: list[list[tuple[float, int]] | None] = [None] * bs
        if sampled_idx:
            top_nums = [
                mwb.top_logprobs_nums[i] if mwb.top_logprobs_nums else 0 for i in sampled_idx
            ]
            out = self.sampler(
                picked,
                mwb.sampling_info,
                return_logprob=mwb.return_logprob,
                top_logprobs_nums=top_nums,
            )
            ids = out.next_token_ids.tolist()
            lps = out.next_token_logprobs.tolist() if out.next_token_logprobs is not None else None
            for j, i in enumerate(sampled_idx):
                next_ids[i] = ids[j]
                if lps is not None:
                    next_lps[i] = lps[j]
                if out.top_logprobs is not None:
                    vals, tids = out.top_logprobs[j]
                    next_tops[i] = list(zip(vals, tids, strict=True))
        result = GenerationBatchResult(next_token_ids=next_ids)
        if mwb.return_logprob:
            result.next_token_logprobs = next_lps
            result.next_top_logprobs = next_tops
            self._input_logprobs(mwb, logits, row_end, result)
        return result

    @staticmethod
    def _input_logprobs(
        mwb: ModelWorkerBatch, logits: torch.Tensor, row_end: list[int], res: GenerationBatchResult
    ) -> None:
        """Logprobs of prompt tokens: row t of request i scores input_logprob_targets[i][t]."""
        res.input_token_logprobs, res.input_top_logprobs = [], []
        for i, targets in enumerate(mwb.input_logprob_targets):
            if not targets:
                res.input_token_logprobs.append([])
                res.input_top_logprobs.append([])
                continue
            start = row_end[i] - mwb.num_logit_rows[i]
            rows = torch.log_softmax(logits[start : start + len(targets)].float(), dim=-1)
            tgt = torch.tensor(targets, device=rows.device)
            res.input_token_logprobs.append(rows.gather(1, tgt[:, None]).squeeze(1).tolist())
            k = mwb.top_logprobs_nums[i] if mwb.top_logprobs_nums else 0
            res.input_top_logprobs.append([top_logprobs_of(r, k) for r in rows])

    # Memory handles, owned and used by the scheduler only.
    @property
    def pools(self) -> tuple:
        r = self.model_runner
        return r.req_to_token_pool, r.token_to_kv_pool_allocator
