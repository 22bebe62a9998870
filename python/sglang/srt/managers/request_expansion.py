"""A /generate request as the scheduler's single requests: a batch of prompts split into one
request per prompt, and n > 1 choices into n requests with rids `rid-k` (upstream's
behaviour: each choice is its own request); the client's rid of a request with n > 1 stands
for all its choices (TokenizerManager.rid_groups)."""

from __future__ import annotations

import copy

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import check_n

SEED_MASK = (1 << 62) - 1
# GenerateReqInput fields that a batch may give per prompt (a list, one entry per prompt).
PER_PROMPT_FIELDS = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num")


def choice_rid(rid: str, k: int) -> str:
    """The request id of choice k of a request with n > 1 (each choice is its own request)."""
    return f"{rid}-{k}"


def response_rid(first_rid: str, n: int) -> str:
    """The id of the request a response answers, from the rid of its first choice: with
    n > 1 that is choice_rid(rid, 0), and OpenAI gives all choices one response id."""
    suffix = choice_rid("", 0)
    return first_rid[: -len(suffix)] if n > 1 and first_rid.endswith(suffix) else first_rid


def num_choices(obj: GenerateReqInput) -> int:
    """The n of a single request's sampling_params (1 when absent or not an integer)."""
    sp = obj.sampling_params
    if isinstance(sp, dict):
        n = sp.get("n", 1)
        return n if isinstance(n, int) and not isinstance(n, bool) else 1
    return 1


def choice_groups(obj: GenerateReqInput) -> dict[str, list[str]]:
    """The client's rid -> its choices' rids, for each prompt of obj that names a rid and asks
    for n > 1 choices (obj as expand_request has validated it)."""
    items = [obj] if obj.is_single() else [obj[i] for i in range(obj.batch_size())]
    return {
        item.rid: [choice_rid(item.rid, k) for k in range(num_choices(item))]
        for item in items
        if isinstance(item.rid, str) and num_choices(item) > 1
    }


def expand_request(obj: GenerateReqInput) -> list[GenerateReqInput]:
    """Split a batch into single requests and expand n > 1 into n copies (choice k's rid
    choice_rid(rid, k), its sampling_seed moved by 7919 k). Raises ValueError naming the field
    for text and input_ids together, a rid or per-prompt field of the wrong shape, an empty
    batch, or a bad n (check_n)."""
    if obj.text is not None and obj.input_ids is not None:
        raise ValueError("give either 'text' or 'input_ids', not both")
    single = obj.is_single()
    if not single and obj.rid is not None:
        if not isinstance(obj.rid, list) or len(obj.rid) != obj.batch_size():
            raise ValueError(
                f"'rid' must be a list with one id per prompt ({obj.batch_size()}) for a batch"
            )
    if single and obj.rid is not None and not isinstance(obj.rid, str):
        raise ValueError("'rid' must be a string for a single prompt")
    for name in PER_PROMPT_FIELDS:
        value = getattr(obj, name)
        if not isinstance(value, list):
            continue
        if single:  # a list here was taken as one value (`[false]` turned logprobs on)
            raise ValueError(f"'{name}' must not be a list for a single prompt")
        if len(value) != obj.batch_size():  # was an IndexError (500) when shorter
            raise ValueError(
                f"'{name}' must have one entry per prompt ({obj.batch_size()}) for a batch, "
                f"got {len(value)}"
            )
    items = [obj] if single else [obj[i] for i in range(obj.batch_size())]
    if not items:
        raise ValueError("the batch of prompts is empty")
    out: list[GenerateReqInput] = []
    for item in items:
        sp = dict(item.sampling_params or {})
        n = check_n(sp.pop("n", 1))
        for k in range(n):
            copy_ = copy.copy(item)
            copy_.sampling_params = dict(sp)
            if n > 1:
                copy_.rid = None if item.rid is None else choice_rid(item.rid, k)
                seed = sp.get("sampling_seed")
                if isinstance(seed, int):
                    copy_.sampling_params["sampling_seed"] = (seed + 7919 * k) & SEED_MASK
            out.append(copy_)
    return out
