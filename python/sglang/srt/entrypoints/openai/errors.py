"""OpenAI-style error bodies and the FastAPI handlers that produce them.

Every error the HTTP server returns has the body OpenAI clients expect:
`{"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}`.
Status codes: 400 invalid request (bad JSON, bad field, prompt longer than the context),
401 missing/wrong API key, 404 unknown route or model, 503 queue full / engine unhealthy.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.managers.request_validation import (
    ContextLengthError,
    MaxTokensError,
    json_too_deep_message,
    raw_json_too_deep,
)

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class OrjsonResponse(Response):
    """JSON response serialized with orjson (tuples, numpy-free floats, NaN -> null)."""

    media_type = "application/json"

    def render(self, content: object) -> bytes:
        return orjson.dumps(content)


class OpenAIError(Exception):
    """An error with an HTTP status, rendered as an OpenAI error body.

    Args:
        message: human readable; names the offending field when there is one.
        status: HTTP status code (400, 401, 404, 503, ...).
        param: the request field at fault, or None.
        code: machine-readable code (e.g. "model_not_found"), or None.
    """

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int, param: str | None = None, code=None) -> dict:
    """The JSON body of an error response (also used for SSE error frames)."""
    err_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    message: str, status: int = 400, param: str | None = None, code=None
) -> OrjsonResponse:
    return OrjsonResponse(error_body(message, status, param, code), status_code=status)


UNAVAILABLE_ERRORS = ("QueueFullError", "ServerClosingError")  # tokenizer_manager.py, by name


def unavailable_error(e: BaseException) -> OpenAIError | None:
    """The 503 (with the exception's `code`) for QueueFullError and ServerClosingError, matched
    by name to avoid an import cycle; None for any other exception."""
    if type(e).__name__ not in UNAVAILABLE_ERRORS:
        return None
    return OpenAIError(str(e) or "the request queue is full", 503, code=e.code)


def from_engine_exception(
    e: BaseException, max_tokens_field: str = "max_new_tokens"
) -> OpenAIError:
    """Map an exception raised by TokenizerManager.generate_request to an OpenAIError.

    ValueError (invalid input; its message names the parameter) -> 400, an output budget beyond
    the context naming `max_tokens_field` (the route's name for max_new_tokens);
    QueueFullError and ServerClosingError -> 503 with their `code` (unavailable_error).
    Anything else is re-raised by the caller as a 500.
    """
    if isinstance(e, OpenAIError):
        return e
    unavailable = unavailable_error(e)
    if unavailable is not None:
        return unavailable
    if isinstance(e, MaxTokensError):
        e = e.for_field(max_tokens_field)
    if isinstance(e, ContextLengthError):
        return OpenAIError(str(e), 400, param=e.param, code=e.code)
    if isinstance(e, (ValueError, TypeError)):
        msg = _route_names(str(e), max_tokens_field)
        return OpenAIError(msg, 400, param=param_named_in(msg))
    raise e


def _route_names(message: str, max_tokens_field: str) -> str:
    """An engine message in the route's field names: the OpenAI routes (max_tokens_field
    max_tokens / max_completion_tokens) call the engine's max_new_tokens, min_new_tokens,
    sampling_seed and input_ids max_tokens (or max_completion_tokens), min_tokens, seed and
    prompt (a completions prompt of token ids becomes input_ids); /generate (max_new_tokens)
    keeps the engine's names."""
    if max_tokens_field == "max_new_tokens":
        return message
    names = {
        "max_new_tokens": max_tokens_field,
        "min_new_tokens": "min_tokens",
        "sampling_seed": "seed",
        "input_ids": "prompt",
    }
    return re.sub(
        r"\b(max_new_tokens|min_new_tokens|sampling_seed|input_ids)\b",
        lambda m: names[m[1]],
        message,
    )


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Request fields an engine error can name (OpenAI names and the engine's sampling parameters).
_REQUEST_FIELDS = {
    "max_tokens", "max_completion_tokens", "messages", "prompt", "model", "n", "logprobs",
    "top_logprobs", "stop", "logit_bias", "stream", "seed", "input_ids", "text", "echo",
    "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "stream_options", "min_tokens", "rid", "content",
}  # fmt: skip


def param_named_in(message: str) -> str | None:
    """The first request field (OpenAI field or SamplingParams attribute) named in an engine
    error message, or None: engine messages name the parameter but may also quote the bad value
    (e.g. "sampling parameter temperature must be a number, got str 'hot'")."""
    import dataclasses

    from sglang.srt.sampling.sampling_params import SamplingParams

    known = _REQUEST_FIELDS | {f.name for f in dataclasses.fields(SamplingParams)}
    for word in _WORD.findall(message):
        if word in known:
            return word
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the union branch in `loc` ("str", "list[int]", "ContentPart", ...)."""
    return part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper()


def _loc_to_param(loc: tuple) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_union_tag(str(p)):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None


def validation_error_to_openai(exc: RequestValidationError) -> OpenAIError:
    """Turn pydantic's error list into one 400 whose message names the first bad field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request", 400)
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return OpenAIError(f"invalid JSON body: {ctx.get('error', first.get('msg'))}", 400)
    param = _loc_to_param(tuple(first.get("loc", ())))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return OpenAIError(
            "the request body must be a JSON object (Content-Type: application/json)", 400
        )
    if param is None and first.get("type") == "missing":  # no body at all
        return OpenAIError(
            "the request body is missing: send a JSON object (Content-Type: application/json)",
            400,
        )
    # One entry per field, in order: a value that fits no branch of a union (prompt: a string,
    # a list of strings, ...) gets one error per branch from pydantic.
    by_param: dict[str | None, list[str]] = {}
    for err in errors:
        p, msg = _loc_to_param(tuple(err.get("loc", ()))), _clean(str(err.get("msg")))
        seen = by_param.setdefault(p, [])
        if msg not in seen:
            seen.append(msg)
    msgs = []
    for p, texts in list(by_param.items())[:3]:
        msg = "; or ".join(texts)
        named = p is None or msg.startswith(p + " ")  # "n must be ..." (protocol.py) names it
        msgs.append(msg if named else f"{p}: {msg}")
    if param is None:  # a model-level check: the field its message names
        param = param_named_in(msgs[0].replace("'", " "))
    return OpenAIError("; ".join(msgs), 400, param=param)


def _clean(msg: str) -> str:
    """pydantic's message without the "Value error, " it puts before a validator's own."""
    return msg.removeprefix("Value error, ")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every error into an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> OrjsonResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> OrjsonResponse:
        e = validation_error_to_openai(exc)
        return error_response(e.message, e.status, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> OrjsonResponse:
        if exc.status_code == 404:
            msg = f"unknown route {request.method} {request.url.path}"
            if request.url.path == "/metrics":  # mounted only with the flag, as upstream
                msg += ": metrics are off; start the server with --enable-metrics"
        elif exc.status_code == 400 and "parsing the body" in str(exc.detail):
            # FastAPI's parser refused it; one nested past the recursion limit says so
            deep = raw_json_too_deep(await request.body())
            msg = json_too_deep_message() if deep else "invalid request body: not valid UTF-8 JSON"
        else:
            msg = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        return error_response(msg, exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> OrjsonResponse:
        logger.exception("internal error while serving a request")
        return error_response(f"internal server error: {exc!r}", 500)
