"""The OpenAI-compatible routes on the HTTP server's FastAPI app.

POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model}.
http_server.create_app registers them with `add_openai_routes`; the app's middleware (API key,
JSON bodies) and error handlers (errors.py) apply to them as to the native routes. The handlers
themselves are serving_completions.py and serving_chat.py (upstream's layout).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.entrypoints.openai.serving_base import (
    check_model,
    guard_client_gone,
    warn_ignored_fields,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.server_args import ServerArgs


def add_openai_routes(app: FastAPI, tm: Any, server_args: ServerArgs) -> None:
    """Add the /v1 routes serving TokenizerManager `tm` to `app`.

    Raises:
        ValueError: --chat-template is neither a file nor an inline Jinja template.
    """
    completions = OpenAIServingCompletion(tm)
    chat = OpenAIServingChat(tm, load_chat_template(server_args.chat_template))

    @app.post("/v1/completions")
    async def v1_completions(req: CompletionRequest, raw: Request) -> Any:
        warn_ignored_fields(req, "/v1/completions")
        return await guard_client_gone(completions.handle(req, raw))

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        warn_ignored_fields(req, "/v1/chat/completions")
        return await guard_client_gone(chat.handle(req, raw))

    def model_card() -> dict:
        return {
            "id": tm.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": server_args.model_path,
            "max_model_len": tm.model_config.context_len,
        }

    @app.get("/v1/models")
    async def v1_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def v1_model(model: str) -> dict:
        """OpenAI's retrieve-model route (client.models.retrieve): the served model's card
        for its name, its path or "default"; 404 model_not_found otherwise."""
        check_model(tm, model)
        return model_card()
