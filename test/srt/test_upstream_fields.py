"""/generate bodies with upstream SGLang fields this server does not implement: served when
those fields ask for nothing (null / their defaults), refused with a 400 naming the field
otherwise, and truly unknown fields still refused (http_server.parse_generate_body,
entrypoints/upstream_fields.py). Found by a new-user helper (twenty-second session): a body
with `"lora_path": null` or `"return_hidden_states": false` got "unknown field(s)"."""

from __future__ import annotations

import json

import pytest

from sglang.srt.entrypoints.http_server import parse_generate_body
from sglang.srt.entrypoints.openai.errors import OpenAIError
from sglang.srt.entrypoints.upstream_fields import INERT_GENERATE_FIELDS

BASE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
INERT = {
    "return_hidden_states": False,
    "lora_path": None,
    "image_data": None,
    "log_metrics": True,
    "no_logs": False,
    "session_params": None,
    "token_ids_logprob": None,
    "custom_labels": None,
    "extra_key": None,
    "priority": None,
}


def parse(body: dict):
    return parse_generate_body(json.dumps(body).encode())


def test_upstream_fields_at_inert_values_are_served_as_if_absent():
    assert parse({**BASE, **INERT}) == parse(BASE)
    batch = {"text": ["a", "b"], "return_hidden_states": [False, False], "lora_path": [None, None]}
    assert parse(batch) == parse({"text": ["a", "b"]})
    assert set(INERT) <= set(INERT_GENERATE_FIELDS)


@pytest.mark.parametrize(
    "field,value",
    [
        ("return_hidden_states", True),
        ("lora_path", "/adapters/a"),
        ("image_data", "cat.png"),
        ("token_ids_logprob", [5]),
        ("priority", 1),
        ("return_hidden_states", [False, True]),
        ("return_hidden_states", 0),  # not the default False itself
        ("log_metrics", "yes"),
    ],
)
def test_upstream_fields_asking_for_something_are_refused_by_name(field, value):
    with pytest.raises(OpenAIError) as e:
        parse({**BASE, field: value})
    assert e.value.status == 400 and e.value.param == field
    assert field in e.value.message and "not support" in e.value.message


def test_unknown_fields_are_still_refused():
    with pytest.raises(OpenAIError, match="unknown field.*max_tokens") as e:
        parse({**BASE, "max_tokens": 3, "lora_path": None})
    assert e.value.status == 400
