"""The HTTP server: a FastAPI app over a TokenizerManager, served by uvicorn on uvloop.

Native endpoints (upstream SGLang): POST /generate, GET /health, GET /health_generate,
GET /get_model_info, GET /get_server_info, GET|POST /flush_cache, POST /abort_request,
GET /metrics (with --enable-metrics), plus the API-key and JSON-body middleware. The OpenAI
endpoints (POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{model}) are added by openai/routes.py. Every error is an OpenAI error body
(openai/errors.py).

`launch_server` starts the engine processes (engine.launch_subprocesses), serves until
SIGINT/SIGTERM, and then stops every child process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import requests
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from sglang.srt.entrypoints.openai.errors import (
    OpenAIError,
    OrjsonResponse,
    error_response,
    install_error_handlers,
)
from sglang.srt.entrypoints.openai.routes import add_openai_routes
from sglang.srt.entrypoints.openai.serving_base import (
    generate_once,
    guard_client_gone,
    open_stream,
    sse_frames,
)
from sglang.srt.entrypoints.upstream_fields import drop_inert_fields
from sglang.srt.managers.io_struct import GENERATE_FIELD_TYPES, GenerateReqInput
from sglang.srt.managers.request_validation import (
    json_too_deep,
    json_too_deep_message,
    lone_surrogate_message,
    lone_surrogate_path,
    raw_json_too_deep,
)
from sglang.srt.metrics.collector import CONTENT_TYPE, TokenizerMetricsCollector
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

READY_MESSAGE = "The server is fired up and ready to roll!"
OPEN_PATHS = ("/health", "/health_generate", "/metrics")  # no API key needed (as upstream)
INTERNAL_STATE_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0


class APIKeyMiddleware:
    """Pure ASGI middleware: 401 unless `Authorization: Bearer <api_key>` (open paths exempt)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization")
        if auth != self.expected:
            msg = "missing API key" if auth is None else "invalid API key"
            resp = error_response(
                f"{msg}: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class JSONBodyMiddleware:
    """Pure ASGI middleware: a POST body is JSON whatever its Content-Type, as upstream's
    handlers read it (`await request.json()`). `curl -d '{...}'` sends
    application/x-www-form-urlencoded, for which FastAPI does not parse the body as JSON and
    the OpenAI routes answered "the request body must be a JSON object"; such a request's
    Content-Type is rewritten to application/json (every route here takes JSON only)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            given = dict(scope.get("headers") or []).get(b"content-type", b"")
            mime = given.split(b";", 1)[0].strip().lower()
            if not (mime == b"application/json" or mime.endswith(b"+json")):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


# ---- /generate body parsing ------------------------------------------------------------------
_GENERATE_FIELDS = {f.name for f in dataclasses.fields(GenerateReqInput)}


def parse_generate_body(body: bytes) -> GenerateReqInput:
    """Decode a /generate body into GenerateReqInput. Raises OpenAIError(400) naming the field."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        try:  # what the OpenAI routes (FastAPI: json.loads) also read: 1e400, NaN, 2**64 ...
            data = json.loads(body)  # ... which the field checks then refuse by name
        except (ValueError, RecursionError):
            if raw_json_too_deep(body):  # one wording whatever the parser's version says
                raise OpenAIError(json_too_deep_message(), 400) from e
            raise OpenAIError(f"invalid JSON body: {e}", 400) from e
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object", 400)
    if json_too_deep(data):
        raise OpenAIError(json_too_deep_message(), 400)
    bad = lone_surrogate_path(data)
    if bad is not None:
        raise OpenAIError(lone_surrogate_message(bad), 400, param=bad)
    unsupported = drop_inert_fields(data)
    if unsupported is not None:
        raise OpenAIError(
            f"'{unsupported}' is an upstream SGLang feature this server does not support; "
            f"send it unset (null) or at its default, or leave it out",
            400,
            param=unsupported,
        )
    unknown = sorted(set(data) - _GENERATE_FIELDS)
    if unknown:
        raise OpenAIError(f"unknown field(s): {', '.join(unknown)}", 400, param=unknown[0])
    if data.get("text") is None and data.get("input_ids") is None:
        raise OpenAIError("either 'text' or 'input_ids' must be given", 400, param="text")
    for name, ok in GENERATE_FIELD_TYPES.items():
        if data.get(name) is not None and not ok(data[name]):
            raise OpenAIError(f"'{name}' has the wrong type", 400, param=name)
    for name in ("text", "input_ids"):
        if data.get(name) is not None and len(data[name]) == 0:
            raise OpenAIError(f"'{name}' must not be empty", 400, param=name)
    return GenerateReqInput(**data)


# ---- app -------------------------------------------------------------------------------------
def create_app(tokenizer_manager: Any, server_args: ServerArgs) -> FastAPI:
    """The FastAPI app serving `tokenizer_manager` (see module docstring for endpoints)."""
    app = FastAPI(title="SGLang", openapi_url=None)
    tm = tokenizer_manager
    app.state.tm = tm
    install_error_handlers(app)
    app.add_middleware(JSONBodyMiddleware)  # JSON bodies without a JSON Content-Type (curl -d)
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    collector = _init_metrics(tm, server_args)
    _add_native_routes(app, tm, server_args)
    add_openai_routes(app, tm, server_args)

    if collector is not None:

        @app.get("/metrics")
        async def metrics() -> Response:
            try:
                state = await asyncio.wait_for(tm.get_internal_state(), INTERNAL_STATE_TIMEOUT_S)
                collector.set_internal_state(state)
            except Exception:  # noqa: BLE001 - counters still worth serving
                logger.warning("metrics: could not read the scheduler's internal state")
            return Response(collector.render(), media_type=CONTENT_TYPE)

    return app


def _init_metrics(tm: Any, server_args: ServerArgs) -> TokenizerMetricsCollector | None:
    if not server_args.enable_metrics:
        return None
    if getattr(tm, "metrics_collector", None) is None:
        tm.metrics_collector = TokenizerMetricsCollector({"model_name": tm.served_model_name})
    return tm.metrics_collector


def _add_native_routes(app: FastAPI, tm: Any, server_args: ServerArgs) -> None:
    @app.post("/generate")
    async def generate(raw: Request) -> Any:
        obj = parse_generate_body(await raw.body())
        if server_args.log_requests:
            logger.info("generate request: %s", obj)
        if obj.stream:  # guarded too: a client gone before the first output is no error
            return await guard_client_gone(_generate_stream(tm, obj, raw))
        return await guard_client_gone(_generate_json(tm, obj, raw))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(raw: Request) -> Response:
        obj = GenerateReqInput(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}
        )
        try:
            await asyncio.wait_for(generate_once(tm, obj, raw), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"health generation failed: {e!r}", 503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        sa = tm.server_args
        return {
            "model_path": sa.model_path,
            "tokenizer_path": sa.tokenizer_path or sa.model_path,
            "is_generation": True,
            "served_model_name": tm.served_model_name,
            "context_length": tm.model_config.context_len,
            "preferred_sampling_params": None,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        state = await asyncio.wait_for(tm.get_internal_state(), INTERNAL_STATE_TIMEOUT_S)
        info = dataclasses.asdict(tm.server_args)
        info.pop("api_key", None)
        return {**info, "internal_states": [state], "version": _version()}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await tm.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return error_response("cache not flushed: requests are still running", 400)

    @app.post("/abort_request")
    async def abort_request(raw: Request) -> Response:
        try:
            data = orjson.loads(await raw.body())
        except orjson.JSONDecodeError as e:
            raise OpenAIError(f"invalid JSON body: {e}", 400) from e
        if not isinstance(data, dict):
            raise OpenAIError("the body must be a JSON object", 400)
        abort_all = data.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise OpenAIError("'abort_all' must be a boolean", 400, param="abort_all")
        if abort_all:  # upstream's AbortReq(abort_all=True): every request in flight
            tm.abort_all()
            return Response(status_code=200)
        if not isinstance(data.get("rid"), str):
            raise OpenAIError("'rid' (string) or 'abort_all': true is required", 400, param="rid")
        tm.abort_request(data["rid"])
        return Response(status_code=200)


async def _generate_json(tm: Any, obj: GenerateReqInput, raw: Request) -> Response:
    return OrjsonResponse(await generate_once(tm, obj, raw))


async def _generate_stream(tm: Any, obj: GenerateReqInput, raw: Request) -> Response:
    stream = await open_stream(tm, obj, raw)  # ClientGone: aborted; guard_client_gone: 499
    return StreamingResponse(sse_frames(stream), media_type="text/event-stream")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return "unknown"


# ---- launch ----------------------------------------------------------------------------------
def launch_server(
    server_args: ServerArgs,
    launch_fn: Callable[[ServerArgs], tuple[Any, list]] | None = None,
) -> None:
    """Start the engine, serve HTTP until SIGINT/SIGTERM, then stop all child processes.

    Args:
        server_args: parsed flags (prepare_server_args).
        launch_fn: engine starter returning (tokenizer_manager, child processes); default
            sglang.srt.entrypoints.engine.launch_subprocesses.
    Raises:
        RuntimeError: the warm-up request failed (the server is stopped first).
    """
    _raise_on_sigterm()
    children: list = []
    warmup_failed = threading.Event()
    try:
        if launch_fn is None:
            from sglang.srt.entrypoints.engine import launch_subprocesses as launch_fn
        tm, children = launch_fn(server_args)
        sa = getattr(tm, "server_args", server_args)
        app = create_app(tm, sa)
        server = _Server(
            tm,
            uvicorn.Config(
                app,
                host=sa.host,
                port=sa.port,
                loop="uvloop",
                log_level=sa.log_level.lower(),
                access_log=False,
                timeout_keep_alive=5,
                timeout_graceful_shutdown=2,
            ),
        )
        threading.Thread(
            target=_warmup, args=(sa, server, warmup_failed), daemon=True, name="warmup"
        ).start()
        server.run()
    finally:
        stop_processes(children)
    if warmup_failed.is_set():
        raise RuntimeError("the warm-up request failed; see the log above")


SHUTDOWN_MESSAGE = "the server is shutting down"


class _Server(uvicorn.Server):
    """uvicorn.Server that, as it begins to stop (SIGINT or SIGTERM), first ends every request
    in flight (TokenizerManager.finish_all_local): open streams then send their last chunk,
    finish_reason abort, and [DONE] within uvicorn's graceful-shutdown wait, instead of being
    cut off when it times out and cancels them with a traceback; requests with nothing sent
    yet, and new ones, get a 503 their clients can retry."""

    def __init__(self, tm: Any, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.tm = tm

    async def shutdown(self, sockets: list | None = None) -> None:
        finish = getattr(self.tm, "finish_all_local", None)
        ended = finish(SHUTDOWN_MESSAGE) if finish is not None else 0
        if ended:
            logger.info(
                "shutting down: ended %d request(s) in flight (a stream under way ends with "
                "finish_reason abort, the others get a 503)",
                ended,
            )
        await super().shutdown(sockets)


def _raise_on_sigterm() -> None:
    """SIGTERM before/after uvicorn runs -> SystemExit, so `finally` blocks stop children."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: never interrupt the cleanup
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# The warm-up batch (upstream sends the first prompt alone). Two prompts arrive together and
# are prefilled as one batch of two, so the eager multi-request prefill's kernels are compiled
# before serving, not at the first burst of concurrent requests: on CUDA a lone prompt replays
# a prefill graph (--cuda-graph-prefill-max-tokens) and compiles nothing of that path.
WARMUP_PROMPTS = ["The capital city of France is", "Water boils at sea level at a temperature of"]


def _warmup(sa: ServerArgs, server: uvicorn.Server, failed: threading.Event) -> None:
    host = "127.0.0.1" if sa.host in ("0.0.0.0", "::", "") else sa.host
    url = f"http://{host}:{sa.port}"
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    if not sa.skip_server_warmup:
        headers = {"Authorization": f"Bearer {sa.api_key}"} if sa.api_key else {}
        body = {
            "text": WARMUP_PROMPTS,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
        }
        try:
            r = requests.post(url + "/generate", json=body, headers=headers, timeout=600)
            r.raise_for_status()
        except Exception as e:  # noqa: BLE001
            if server.should_exit:  # stopped during the warm-up (SIGINT/SIGTERM): no failure
                return
            logger.error("warm-up request failed: %r", e)
            failed.set()
            server.should_exit = True
            return
    if not server.should_exit:
        logger.info("%s URL: %s", READY_MESSAGE, url)


def _descendants(pid: int) -> list[int]:
    """All descendant pids of `pid`, read from /proc (Linux); [] elsewhere."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop_processes(procs: list, timeout_s: float = 3.0) -> None:
    """SIGTERM `procs` (multiprocessing.Process or Popen), wait up to timeout_s, then SIGKILL
    them and any other descendant of this process that is still alive."""
    others = _descendants(os.getpid())
    for p in procs:
        try:
            p.terminate()
        except Exception:  # noqa: BLE001 - already gone
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        left = max(0.0, deadline - time.monotonic())
        if hasattr(p, "join"):
            p.join(left)
        else:
            _wait(p, left)
    for pid in set(others) | set(_descendants(os.getpid())):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in procs:
        if hasattr(p, "join"):
            p.join(0.5)


def _wait(p: Any, timeout_s: float) -> None:
    try:
        p.wait(timeout_s)
    except Exception:  # noqa: BLE001
        pass
