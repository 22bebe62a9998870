"""Startup warm-up sweep for the step-time model: synthetic decode steps on the real worker.

A synthetic step gives `bs` fake requests a context of `context_len` tokens (KV slots are
allocated but hold garbage; only timing matters), a draft catch-up over the last `catchup`
positions (default one), and `d` draft tokens each (d = 0: a plain decode step), then runs
the speculative worker exactly as a real step would (EAGLEWorkerV2.forward_batch_generation).
Every slot is freed afterwards, so the pools are as before. Runs before any request is admitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sglang.srt.managers.schedule_batch import ModelWorkerBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.adaptive.step_time_fit import profile_step_time
from sglang.srt.speculative.spec_info import SpecPlan

logger = logging.getLogger(__name__)

# Pending positions per request of the warm-up sweep's catch-up steps (profile_step_time's
# catchup_probe; capped by the sweep's context length): what tells the draft model's tokens
# from the verify's in the fit; only at the batch sizes whose catch-up extend has at most
# PROFILE_CATCHUP_MAX_TOKENS tokens (63 x 64; bs 256 would be 16,128, twice the default chunked
# prefill, a start-up activation peak outside --mem-fraction-static). Odd, so that the probes'
# catch-ups (63 x bs tokens) have odd and even token counts, as real ones do: a kernel that
# still specialized on them would compile its variants here rather than while serving (the
# attention kernels' index vectors did until the twenty-eighth session: docs/gpu_fast_path.md).
PROFILE_CATCHUP = 63
PROFILE_CATCHUP_MAX_TOKENS = 4096


def make_synthetic_step(scheduler: Any, context_len: int) -> Callable[..., float]:
    """run_step(bs, d, catchup=1) -> forward seconds of one synthetic step on
    scheduler.tp_worker (catchup: pending positions each drafting request catches its draft up
    over, 1..context_len). Raises RuntimeError when the pools cannot hold bs requests of
    context_len + 1 + d tokens, ValueError for a catchup outside 1..context_len."""
    s = scheduler
    worker, mc = s.tp_worker, s.model_config
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)

    def run_step(bs: int, d: int, catchup: int = 1) -> float:
        if not 1 <= catchup <= context_len:
            raise ValueError(f"synthetic step: catchup must be in 1..{context_len}, got {catchup}")
        per_req = context_len + 1 + d
        rows = s.req_to_token_pool.alloc(bs)
        slots = s.allocator.alloc(bs * per_req) if rows is not None else None
        if slots is None:
            if rows is not None:
                for r in rows:
                    s.req_to_token_pool.free(r)
            raise RuntimeError(f"synthetic step: no room for {bs} x {per_req} tokens")
        try:
            for i, r in enumerate(rows):
                s.req_to_token_pool.write(r, 0, slots[i * per_req : (i + 1) * per_req])
            return worker.forward_batch_generation(
                _batch(rows, slots, d, context_len, catchup)
            ).forward_time_s
        finally:
            s.allocator.free(slots)
            for r in rows:
                s.req_to_token_pool.free(r)

    def _batch(rows: list[int], slots: torch.Tensor, d: int, n: int, p: int) -> ModelWorkerBatch:
        bs, per_req = len(rows), n + 1 + d
        tok = [100 + i for i in range(bs)]
        step = torch.cat([slots[i * per_req + n : (i + 1) * per_req] for i in range(bs)])
        plan = SpecPlan(draft_lens=[d] * bs)
        for i in range(bs):
            # positions n - p .. n - 1, each with the next token's id (any id: timing only)
            plan.catchup_ids.append([tok[i]] * p if d else [])
            plan.catchup_prefix_lens.append(n - p if d else 0)
            last = slots[i * per_req + n - p : i * per_req + n]
            # the pending positions' hidden states: whatever their pool rows hold (timing only)
            plan.catchup_slots.append(last.numpy().astype(np.int64) if d else None)
        info = SamplingBatchInfo.from_rows(
            [SamplingRow(greedy, [tok[i]], [], i) for i in range(bs)], mc.vocab_size, worker.device
        )
        return ModelWorkerBatch(
            forward_mode=ForwardMode.TARGET_VERIFY if d else ForwardMode.DECODE,
            input_ids=torch.tensor([t for i in range(bs) for t in [tok[i]] + [0] * d]),
            out_cache_loc=step.to(torch.int64),
            req_pool_indices=list(rows),
            seq_lens=[n + 1 + d] * bs,
            extend_prefix_lens=[n] * bs,
            extend_seq_lens=[1 + d] * bs,
            num_logit_rows=[1 + d] * bs,
            sample=[True] * bs,
            input_logprob_targets=[[] for _ in range(bs)],
            sampling_info=info,
            top_logprobs_nums=[0] * bs,
            spec=plan,
        )

    return run_step


def profile_controller(
    controller: Any,
    run_step: Callable[..., float | None],
    context_len: int,
    max_batch_size: int | None = None,
) -> None:
    """Warm-up sweep (see profile_step_time) of an AdaptiveController over its
    cfg.profile_batch_sizes (those up to max_batch_size) and d = 0..K, plus a catch-up step over
    min(PROFILE_CATCHUP, context_len) positions per batch size (run_step(bs, 1, p), up to
    PROFILE_CATCHUP_MAX_TOKENS tokens in all); the fitted coefficients become its step-time
    prior. Skipped when cfg.profile is off or cfg.time_model fixes the coefficients."""
    cfg = controller.cfg
    if not cfg.profile or cfg.time_model is not None:
        return
    sizes = [b for b in cfg.profile_batch_sizes if max_batch_size is None or b <= max_batch_size]
    if not sizes:
        return
    coef = profile_step_time(
        run_step,
        sizes,
        range(controller.k + 1),
        context_len,
        catchup_probe=min(PROFILE_CATCHUP, context_len),
        catchup_max_tokens=PROFILE_CATCHUP_MAX_TOKENS,
    )
    controller.time_model.set_prior(coef)
    logger.info("speculative step-time model from warm-up sweep: %s", coef)


def profile_on_worker(scheduler: Any, controller: Any, context_len: int = 512) -> None:
    """profile_controller with synthetic steps, over the configured batch sizes that fit the
    pools (context_len is capped by the model's context length)."""
    s = scheduler
    k = controller.k
    ctx = max(2, min(context_len, s.model_config.context_len - k - 2))
    fit = min(s.req_to_token_pool.available_size(), s.allocator.available_size() // (ctx + 1 + k))
    t0 = time.perf_counter()
    profile_controller(controller, make_synthetic_step(s, ctx), ctx, max_batch_size=fit)
    logger.info("adaptive speculation warm-up sweep took %.1f s", time.perf_counter() - t0)
