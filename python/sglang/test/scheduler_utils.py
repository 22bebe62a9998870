"""Drive a Scheduler in-process (no ZMQ, no subprocess) for scheduler-level tests."""

from __future__ import annotations

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    TokenizedGenerateReqInput,
    merge_spec,
    spec_meta,
)
from sglang.srt.managers.request_validation import build_sampling_params
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_resolve import resolve_server_args


def make_scheduler(model_path: str, **kwargs) -> Scheduler:
    sa = resolve_server_args(ServerArgs(model_path=model_path, **kwargs))
    mc = ModelConfig(sa.model_path, sa.context_length, sa.dtype, sa.device)
    return Scheduler(sa, mc)


def submit(
    sched: Scheduler,
    rid: str,
    input_ids: list[int],
    params: dict,
    seed: int = 0,
    return_logprob: bool = False,
    stream: bool = False,
    logprob_start_len: int = -1,
) -> None:
    sp = build_sampling_params(params, sched.tokenizer, sched.model_config)
    msg = TokenizedGenerateReqInput(
        rid, None, input_ids, sp, return_logprob, logprob_start_len, 0, stream, seed
    )
    sched.handle_message(msg)


def abort(sched: Scheduler, rid: str) -> None:
    sched.handle_message(AbortReq(rid))


def collect(sched: Scheduler, outputs: dict[str, dict]) -> None:
    """Move the scheduler's local outbox into `outputs` (rid -> {"output_ids", "finish", ...})."""
    for msg in sched.outputs.local_outbox:
        if not isinstance(msg, BatchStrOut):
            continue
        for i, rid in enumerate(msg.rids):
            out = outputs.setdefault(rid, {"output_ids": [], "finish": None})
            out["output_ids"].extend(msg.output_ids_delta[i])
            out["text"] = msg.apply_text_delta(i, out.get("text", ""))
            out["meta"] = dict(msg.meta[i])
            if msg.spec:  # the tokenizer manager's expansion of the speculative counters
                out["spec"] = merge_spec(out.get("spec"), msg.spec[i])
                out["meta"].update(spec_meta(out["spec"], out["meta"]["completion_tokens"]))
            out["logprobs"] = out.get("logprobs", []) + list(
                msg.output_token_logprobs_delta[i] or []
            )
            if msg.input_token_logprobs and msg.input_token_logprobs[i] is not None:
                out["input_logprobs"] = list(msg.input_token_logprobs[i])
            if msg.finished_reason[i] is not None:
                out["finish"] = msg.finished_reason[i]
    sched.outputs.local_outbox.clear()


def run_until_idle(sched: Scheduler, outputs: dict[str, dict], max_steps: int = 100000) -> None:
    for _ in range(max_steps):
        if sched.is_idle():
            break
        sched.step()
        collect(sched, outputs)
    collect(sched, outputs)


def record_draft_proposals(worker) -> dict[int, list[int]]:
    """Wrap a speculative worker's draft_tokens so that every drafting request's proposals
    are recorded by position: {extend prefix length (= the position of x_n): drafts}, a later
    step at the same position overwriting an earlier one. Returns the dict it fills."""
    from sglang.srt.speculative.eagle_worker_v2 import drafts_by_request

    proposals: dict[int, list[int]] = {}
    real = worker.draft_tokens

    def record(mwb):
        drafts, q = real(mwb)
        by_req = drafts_by_request(drafts, mwb.spec.draft_lens)
        for pos, ds in zip(mwb.extend_prefix_lens, by_req, strict=True):
            if ds:
                proposals[pos] = ds
        return drafts, q

    worker.draft_tokens = record
    return proposals


def record_step_proposals(worker) -> list[list[list[int]]]:
    """Wrap a speculative worker's draft_tokens so that each drafting step's proposals (per
    request of the step, its d_i draft ids) are appended, in step order, to the list it
    returns."""
    from sglang.srt.speculative.eagle_worker_v2 import drafts_by_request

    steps: list[list[list[int]]] = []
    real = worker.draft_tokens

    def record(mwb):
        drafts, q = real(mwb)
        steps.append(drafts_by_request(drafts, mwb.spec.draft_lens))
        return drafts, q

    worker.draft_tokens = record
    return steps


def count_calls(obj, name: str, counts: dict[str, int], key: str) -> None:
    """Wrap obj.<name> so that each call adds 1 to counts[key] (the call itself unchanged)."""
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return real(*args, **kwargs)

    setattr(obj, name, counted)
