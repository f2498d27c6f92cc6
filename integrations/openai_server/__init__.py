"""OpenAI-compatible HTTP server (+ websocket chat, Prometheus metrics) around an AsyncLLMEngine.

    from asyncengine.integrations.openai_server import build_app, serve
    app = build_app(engine, served_model_name="my-model", api_key=None)   # any ASGI server
    serve(model="path/to/model", host="127.0.0.1", port=8000)             # uvicorn + uvloop

or from the shell: ``asyncengine serve MODEL --host 127.0.0.1 --port 8000 [--api-key KEY]``.
"""
from .app import build_app
from .errors import APIError
from .server import serve

__all__ = ["build_app", "serve", "APIError"]
