"""The OpenAI-compatible HTTP server: its configuration and its routes. The work behind the routes is in
serving.py; the front door (auth, limits, the request log) in middleware.py; errors in errors.py; JSON in render.py."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

import serval
from serval.engine.client import EngineClient
from serval.server.config import ServerConfig
from serval.server.errors import install_error_handlers
from serval.server.metrics import ServerMetrics
from serval.server.middleware import FrontDoor
from serval.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from serval.server.responses import ResponsesRequest
from serval.server.serving import OpenAIServing, json_answer

STATIC = Path(__file__).parent / "static"


# What a GET route also answers: HEAD (load balancers and uptime checks probe /health that way).
READ_METHODS = ["GET", "HEAD"]


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI(title="Serval", version=serval.__version__)
    metrics = ServerMetrics(engine)
    flags = {"draining": False, "admitting": 0}  # draining: set on SIGTERM (cli.py); admitting: serving.py's
    serving = OpenAIServing(engine, config, metrics, flags)
    app.state.engine, app.state.config, app.state.metrics, app.state.flags = engine, config, metrics, flags
    install_error_handlers(app, metrics)
    app.add_middleware(FrontDoor, config=config, flags=flags, metrics=metrics)

    # -- plain endpoints ---------------------------------------------------------------------------------------
    @app.api_route("/health", methods=READ_METHODS)
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "dead", "error": str(engine.error)}, status_code=503)
        if engine.kv_transfer_address is not None:  # a prefill worker: where a router sends decode workers
            return {"status": "ok", "kv_transfer": {"role": "prefill", "address": engine.kv_transfer_address}}
        return {"status": "ok"}

    @app.api_route("/version", methods=READ_METHODS)
    async def version():
        return {"version": serval.__version__}

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics_endpoint():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": now(),
                                            "owned_by": "serval", "max_model_len": engine.max_model_len,
                                            "sampling_defaults": engine.sampling_defaults.values,
                                            "chat_template": engine.tokenizer.chat_template_source}]}

    @app.api_route("/engine/state", methods=READ_METHODS)
    async def engine_state():
        """The live view's data: batch, queue, KV use."""
        s = engine.snapshot()
        return {**s.__dict__, "max_model_len": engine.max_model_len, "alive": engine.is_alive}

    @app.api_route("/debug/kv", methods=READ_METHODS)
    async def debug_kv(request: Request):
        """The KV cache now: blocks by tier and state (owned, owned by sessions, cached-free, empty), the prefix
        cache's hit rate, the caller's kept conversation sessions. Needs the API key when the server has one."""
        return await serving.kv_state_for(request)

    @app.api_route("/", methods=READ_METHODS)
    async def index():
        return FileResponse(STATIC / "index.html")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body)

    # -- generation --------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await json_answer(await serving.completions(body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await json_answer(await serving.chat(body, request))

    @app.delete("/v1/sessions/{session_id}")
    async def end_session(session_id: str, request: Request):
        """Lets a conversation's kept KV go now (it stays in the prefix cache as free blocks)."""
        return await serving.end_session(session_id, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await json_answer(await serving.responses(body, request))

    @app.api_route("/v1/responses/{response_id}", methods=READ_METHODS)
    async def get_response(response_id: str, request: Request):
        return serving.stored_response(response_id, request)

    return app
