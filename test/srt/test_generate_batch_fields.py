"""/generate's per-prompt list fields (sampling_params, return_logprob, logprob_start_len,
top_logprobs_num): a batch needs one entry per prompt, a single prompt takes no list. A batch
with a shorter list was an IndexError (HTTP 500); a single prompt's `"return_logprob": [false]`
turned logprobs on."""

from __future__ import annotations

import pytest

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager


def _expand(**kw) -> list[GenerateReqInput]:
    return object.__new__(TokenizerManager)._expand(GenerateReqInput(**kw))


BAD = [
    ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob"),
    ({"text": ["a", "b"], "logprob_start_len": [0]}, "logprob_start_len"),
    ({"text": ["a", "b"], "top_logprobs_num": [1, 2, 3]}, "top_logprobs_num"),
]


@pytest.mark.parametrize("kw,field", BAD, ids=[str(i) for i in range(len(BAD))])
def test_batch_list_of_wrong_length_is_a_value_error(kw, field):
    with pytest.raises(ValueError, match=rf"'{field}' must have one entry per prompt \(2\)"):
        _expand(**kw)


@pytest.mark.parametrize("field,value", [("sampling_params", [{}]), ("return_logprob", [False])])
def test_single_prompt_refuses_a_list(field, value):
    with pytest.raises(ValueError, match=rf"'{field}' must not be a list for a single prompt"):
        _expand(text="a", **{field: value})


def test_matching_lists_and_scalars_still_expand():
    items = _expand(
        text=["a", "b"],
        sampling_params=[{"max_new_tokens": 1, "n": 2}, {"max_new_tokens": 2}],
        return_logprob=[True, False],
        top_logprobs_num=3,
    )
    assert [i.text for i in items] == ["a", "a", "b"]
    assert [i.sampling_params["max_new_tokens"] for i in items] == [1, 1, 2]
    assert [i.return_logprob for i in items] == [True, True, False]
    assert all(i.top_logprobs_num == 3 for i in items)
    single = _expand(text="a", sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert len(single) == 1 and single[0].return_logprob is True


def test_json_depth_check_is_iterative():
    from sglang.srt.managers.request_validation import MAX_JSON_DEPTH, json_too_deep

    def nested(depth: int) -> list:
        v: list = []
        for _ in range(depth - 1):
            v = [v]
        return v

    assert not json_too_deep({"a": nested(MAX_JSON_DEPTH - 1)})
    assert json_too_deep({"a": nested(MAX_JSON_DEPTH)})
    assert json_too_deep({"a": [{"b": nested(100_000)}]})  # no RecursionError
    assert not json_too_deep({"messages": [{"role": "user", "content": [{"text": "x"}]}]})
