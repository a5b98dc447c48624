"""Every failure a route can meet, as OpenAI's JSON error body with its HTTP status (counted in the metrics)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serval.engine.client import EngineDeadError
from serval.server.metrics import ServerMetrics
from serval.server.protocol import OpenAIError, reported_error


def error_response(err: OpenAIError, metrics: ServerMetrics) -> JSONResponse:
    metrics.http_errors.labels(str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def engine_dead(exc: EngineDeadError) -> OpenAIError:
    return OpenAIError(str(exc), status=503, type="server_error", code="engine_dead")


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Makes ``app`` answer every exception a route raises in OpenAI's shape."""

    async def openai_error(request: Request, exc: OpenAIError):
        return error_response(exc, metrics)

    async def dead_engine(request: Request, exc: EngineDeadError):
        """The engine died under a request that was not streamed (the server exits once every open one is
        answered)."""
        return error_response(engine_dead(exc), metrics)

    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(routing_error(request, exc), metrics)

    async def internal_error(request: Request, exc: Exception):
        """A bug: the client gets a 500 in OpenAI's shape; the traceback still goes to the log (Starlette re-raises
        after this response)."""
        request_id = getattr(request.state, "request_id", None)
        return error_response(OpenAIError(f"internal server error (request id {request_id})", status=500,
                                          type="server_error", code="internal_error"), metrics)

    async def invalid_request(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc), metrics)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(EngineDeadError, dead_engine)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_exception_handler(RequestValidationError, invalid_request)


def routing_error(request: Request, exc: StarletteHTTPException) -> OpenAIError:
    """Routing's own errors (no such path: 404, wrong method: 405 with its Allow header), in OpenAI's shape."""
    route = f"{request.method} {request.url.path}"
    message = {404: f"Invalid URL ({route})", 405: f"Method not allowed ({route})"}.get(exc.status_code,
                                                                                          f"{exc.detail} ({route})")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return OpenAIError(message, status=exc.status_code, code=code, headers=exc.headers,
                       type="server_error" if exc.status_code >= 500 else "invalid_request_error")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """A body the schema refused: its first error, naming the field (``param``) it is about."""
    path, first = reported_error(list(exc.errors()), exc.body)
    param = ".".join(map(str, path))
    if first.get("type") == "json_invalid":
        return OpenAIError(f"invalid JSON body: {first.get('msg')}", code="invalid_json")
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return OpenAIError(message, param=param or None, code="invalid_value")
