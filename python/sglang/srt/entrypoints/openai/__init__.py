"""OpenAI-compatible API: the /v1 routes on the app (routes.py), request models (protocol.py),
the engine driver the endpoints share (serving_base.py), /v1/completions and
/v1/chat/completions handlers (serving_completions.py, serving_chat.py) and error bodies
(errors.py)."""
