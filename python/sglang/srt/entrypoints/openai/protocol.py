"""Pydantic models of the OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions).

Field names, defaults and ranges follow the OpenAI API; SGLang's extra sampling fields (top_k,
min_p, repetition_penalty, ...) are accepted at the top level, which is where the openai client's
`extra_body` puts them. Invalid values fail validation, and the server answers 400 with a message
naming the field (see errors.py). As in OpenAI's API and /generate, integer fields take JSON
integers only (2.0, true and "2" are refused) and number fields finite numbers only (not true,
"0.5" or Infinity); the error names the field and its range. Top-level fields a model does not
declare are kept (pydantic's model_extra), not refused, since SGLang clients send extra_body
fields; the routes log their names once per request as ignored. Responses are built as plain
dicts by the serving modules.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from sglang.srt.entrypoints.openai.errors import OpenAIError
from sglang.srt.managers.request_validation import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    check_n,
    json_too_deep,
    json_too_deep_message,
    lone_surrogate_message,
    lone_surrogate_path,
)
from sglang.srt.sampling.sampling_params import json_text

_ALLOWED_ROLES = ("system", "user", "assistant", "tool", "developer")


def _number_kind(annotation: Any) -> tuple[type, bool] | None:
    """(int, False) for `int` / `int | None` fields, (int, True) for `list[int] | None`, float
    likewise; None for other fields."""
    args = set(get_args(annotation)) or {annotation}
    args.discard(type(None))
    if len(args) != 1:
        return None
    (arg,) = args
    is_list = len(get_args(arg)) == 1  # list[int]
    arg = get_args(arg)[0] if is_list else arg
    return (arg, is_list) if arg in (int, float) else None


def _range_text(field: FieldInfo) -> str:
    """' in [0, 20]', ' >= 0', ... from the field's Field(ge=, gt=, le=, lt=) bounds."""
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, Ge):
            lo = ("[", m.ge)
        elif isinstance(m, Gt):
            lo = ("(", m.gt)
        elif isinstance(m, Le):
            hi = ("]", m.le)
        elif isinstance(m, Lt):
            hi = (")", m.lt)
    if lo and hi:
        return f" in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    if hi:
        return f" {'<=' if hi[0] == ']' else '<'} {hi[1]:g}"
    return ""


def _is_number(v: Any, kind: type) -> bool:
    if isinstance(v, bool) or not isinstance(v, kind if kind is int else (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)


def _strict_number(model: type[BaseModel], v: Any, info: ValidationInfo) -> Any:
    """Refuse what pydantic's lax mode would coerce into an int / float field: 2.0, true or "2"
    for an int (OpenAI's API and /generate refuse them), true, "0.5" or Infinity for a float.
    The error names the field and its range: "max_tokens must be an integer >= 0, got 1e+20"."""
    field = model.model_fields[info.field_name]
    kind = _number_kind(field.annotation)
    if kind is None or v is None:
        return v
    kind, is_list = kind
    if is_list and not isinstance(v, list):
        return v  # pydantic's own list_type error
    if all(_is_number(x, kind) for x in (v if is_list else [v])):
        return v
    what = "an integer" if kind is int else "a finite number"
    what = f"a list of {'integers' if kind is int else 'finite numbers'}" if is_list else what
    raise PydanticCustomError(
        "strict_number",
        "{field} must be {what}{range}, got {value}",
        {
            "field": info.field_name,
            "what": what,
            "range": _range_text(field),
            "value": json_text(v),
        },
    )


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat; `to_sampling_params` maps them to SGLang's
    native sampling_params dict (upstream names: max_new_tokens, sampling_seed, ...).

    Undeclared top-level fields land in `model_extra` (read by nothing but the routes' warning
    that names them as ignored)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """A string with a lone UTF-16 surrogate ("\\udc80" in the JSON) anywhere in the body
        is a 400 naming its path (raised as OpenAIError, which pydantic does not wrap). A body
        nested too deeply for that walk is a 400 too."""
        if json_too_deep(data):
            raise OpenAIError(json_too_deep_message(), 400)
        bad = lone_surrogate_path(data)
        if bad is not None:
            raise OpenAIError(lone_surrogate_message(bad), 400, param=bad)
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:  # as upstream and OpenAI
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return self

    model: str = "default"
    n: int = Field(1, ge=1, le=MAX_N)  # checked by check_n, as /generate's n
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None  # token id -> bias: checked by the engine
    user: str | None = None
    # SGLang extensions (openai's extra_body)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    max_draft_tokens: int | None = Field(None, ge=0)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    rid: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name == "n":  # /generate's rule and wording
            if v is None:  # OpenAI's n is nullable: null means the default, 1
                return 1
            try:
                return check_n(v)
            except ValueError as e:
                raise PydanticCustomError("n_range", str(e)) from None
        return _strict_number(cls, v, info)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(not isinstance(s, str) or s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if v == "":
            raise ValueError("stop string must be non-empty")
        return v

    def to_sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """The native `sampling_params` dict; unset fields are left out (engine defaults)."""
        sp: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "n": self.n,
            "stop": self.stop,
            "sampling_seed": self.seed,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
            "max_draft_tokens": self.max_draft_tokens,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
        }
        return {k: v for k, v in sp.items() if v is not None and not (k == "n" and v == 1)}


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _best_of_equals_n(self) -> CompletionRequest:
        """best_of must be >= n (OpenAI's rule); the server generates n completions and does
        not rank extra candidates, so any best_of other than n is refused, not ignored."""
        if self.best_of is None or self.best_of == self.n:
            return self
        if self.best_of < self.n:
            msg = f"best_of must be >= n (got best_of={self.best_of}, n={self.n})"
        else:
            msg = (
                f"best_of is not supported other than equal to n (got best_of={self.best_of}, "
                f"n={self.n}); leave it out or set it to n"
            )
        raise OpenAIError(msg, 400, param="best_of")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_ids_are_ints(cls, v: Any) -> Any:
        """Token ids must be JSON integers, as /generate's input_ids (not 1.0 or true)."""
        ids = (
            [x for p in v for x in (p if isinstance(p, list) else [p])]
            if isinstance(v, list)
            else []
        )
        bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, (int, str))]
        if bad:
            raise PydanticCustomError(
                "strict_number",
                "prompt token ids must be integers, got {value}",
                {"value": json_text(bad[0])},
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and (len(v) == 0 or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in _ALLOWED_ROLES:
            raise ValueError(f"unknown role '{v}'; expected one of {', '.join(_ALLOWED_ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"unsupported content part type '{part.type}'; only 'text' parts "
                        "with a 'text' field are supported"
                    )
        return v

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # OpenAI: only an assistant
            raise ValueError(f"'content' is required in a '{self.role}' message")  # may omit it
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    # >= 1 as OpenAI's chat API requires (completions and /generate take 0: prompt scoring)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule (vLLM checks it too)
            # OpenAIError (pydantic passes it through): a model-level check has no field of
            # its own in pydantic's error, and the body's param must still name it
            raise OpenAIError("'top_logprobs' needs 'logprobs': true", 400, param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _forced_tool_needs_tools(self) -> ChatCompletionRequest:
        """tool_choice "required" or a named function forces a tool call, which needs tools;
        "none" and "auto" without tools are accepted (this server's choice, as vLLM's: OpenAI
        may refuse any tool_choice without tools). Another string is refused."""
        tc = self.tool_choice
        if isinstance(tc, str) and tc not in ("none", "auto", "required"):
            raise OpenAIError(
                f"tool_choice must be 'none', 'auto', 'required' or a function object, got "
                f"{json_text(tc)}",
                400,
                param="tool_choice",
            )
        if self.tools or tc in (None, "none", "auto"):
            return self
        if isinstance(tc, dict):
            fn = tc.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            what = f"naming function {json_text(name)}" if isinstance(name, str) else json_text(tc)
        else:
            what = "'required'"
        raise OpenAIError(f"tool_choice {what} needs tools", 400, param="tool_choice")

    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def max_tokens_field(self) -> str:
        """The field max_new_tokens() came from (errors name it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


FinishReason = Literal["stop", "length", "abort"] | None
