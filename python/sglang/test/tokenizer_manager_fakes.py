"""A TokenizerManager without processes or sockets, and scheduler output messages for it, for
CPU tests of its request bookkeeping (rid reuse, aborts, shutdown)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.managers.io_struct import BatchStrOut, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager


def fake_tokenizer_manager() -> tuple[TokenizerManager, list]:
    """(manager, sent): every request tokenizes to 3 ids; what it would send to the scheduler
    is appended to `sent`; a batch's rid list expands to one single request per rid."""
    tm = object.__new__(TokenizerManager)
    sent: list = []
    tm.rid_to_state = {}
    tm.rid_groups = {}
    tm.metrics_collector = None
    tm.server_args = SimpleNamespace(
        log_requests=False, max_queued_requests=None, max_running_requests=8
    )
    tm._send = sent.append
    tm._ensure_handle_loop = lambda: None
    tm._tokenize = lambda o: SimpleNamespace(rid=o.rid, input_ids=[1, 2, 3], return_logprob=False)
    tm._expand = lambda obj: (
        [obj]
        if isinstance(obj.rid, str)
        else [GenerateReqInput(rid=r, stream=obj.stream) for r in obj.rid]
    )
    return tm, sent


def batch_out(rid: str, ids: list[int], finished_reason: dict | None = None) -> BatchStrOut:
    """The scheduler's output for one request: `ids` new tokens (text "x" per token), final
    when finished_reason is given."""
    n = len(ids)
    return BatchStrOut(
        rids=[rid],
        text=["x" * n],
        output_ids_delta=[ids],
        finished_reason=[finished_reason],
        meta=[{"prompt_tokens": 3, "completion_tokens": n, "cached_tokens": 0}],
        output_token_logprobs_delta=[None],
        output_top_logprobs_delta=[None],
        input_token_logprobs=[None],
        input_top_logprobs=[None],
        first_token_time=[None],
    )
