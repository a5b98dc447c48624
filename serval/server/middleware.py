"""The front door every HTTP request passes: its id, its body's size, the API key, draining; and its one log line."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from fastapi import Request
from starlette.datastructures import MutableHeaders

from serval.outputs import RequestOutput
from serval.server.errors import error_response
from serval.server.metrics import ServerMetrics
from serval.server.protocol import OpenAIError, new_id
from serval.server.render import usage
from serval.server.tenancy import tenant_of

if TYPE_CHECKING:
    from serval.server.config import ServerConfig

request_log = logging.getLogger("serval.requests")
POLLED_PATHS = ("/health", "/metrics", "/engine/state")  # probes and the live view: logged at DEBUG, not INFO


class FrontDoor:
    """A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one runs the route in a task of its own and
    hands every body chunk across a memory stream, a hop per SSE chunk of every stream."""

    def __init__(self, app, config: ServerConfig, flags: dict, metrics: ServerMetrics) -> None:
        self.inner, self.config, self.flags, self.metrics = app, config, flags, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        started = time.monotonic()
        request = Request(scope, receive)
        request_id = request.headers.get("x-request-id") or new_id("req")
        request.state.request_id = request_id
        path = request.url.path
        # The request's log line, filled in on the way (a streamed generation logs it when the stream ends).
        log = request.state.log = {"request_id": request_id, "method": request.method, "path": path, "status": None}
        request.state.started = started
        tracing = self.config.tracing
        if tracing is not None and request.method == "POST" and path.startswith("/v1/"):
            # Ended with the request's log line (a stream's at its end), with its queue/prefill/decode phases.
            log["_trace"] = (tracing, tracing.start_span(f"POST {path}", request.headers, start_monotonic=started))

        async def send_marked(message) -> None:
            if message["type"] == "http.response.start":
                log["status"] = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-Id"] = request_id
                dropped = scope["state"].get("dropped_messages", 0)
                if dropped:
                    headers["X-Serval-Dropped-Messages"] = str(dropped)
            await send(message)

        length = int(request.headers.get("content-length") or 0)
        if "content-length" not in request.headers and request.method in ("POST", "PUT", "PATCH"):
            length, receive = await read_chunked_body(request, self.config.max_body_bytes)
        refusal = None
        if length > self.config.max_body_bytes:
            refusal = OpenAIError(f"request body is {length} bytes; the limit is {self.config.max_body_bytes}",
                                  status=413, code="request_too_large")
        refusal = refusal or self.refuse(request, path)
        try:
            if refusal is not None:
                await error_response(refusal, self.metrics)(scope, receive, send_marked)
            else:
                await self.inner(scope, receive, send_marked)
        except Exception:
            log["status"] = 500
            log_request(log, started)
            raise
        if not scope["state"].get("logged_by_stream", False):
            log_request(log, started, logging.DEBUG if path in POLLED_PATHS else logging.INFO)

    def refuse(self, request: Request, path: str) -> OpenAIError | None:
        """Why the front door turns this request away, if it does (the body's size was checked before)."""
        config = self.config
        # With keys, every route needs one but the chat page (it asks for the key), the liveness probe and the
        # Prometheus scrape (as vLLM), each of the two unless its --protect-* flag is set.
        open_to_all = path == "/" or (path == "/health" and not config.protect_health) or (
            path == "/metrics" and not config.protect_metrics)
        if config.api_keys and not open_to_all:
            auth = request.headers.get("authorization", "")
            key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
            if key not in config.api_keys:
                return OpenAIError("invalid or missing API key (send Authorization: Bearer KEY)", status=401,
                                   type="authentication_error", code="invalid_api_key")
        if self.flags["draining"] and path.startswith("/v1") and request.method == "POST":
            return OpenAIError("the server is shutting down", status=503, type="server_error", code="shutting_down")
        return None


async def read_chunked_body(request: Request, limit: int):
    """Reads a body sent without a Content-Length (chunked), stopping past ``limit`` bytes. Returns its size and
    the receive callable the route reads instead: it hands over what was read, then the connection's own events."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            break
        chunks.append(chunk)
    pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    receive = request.receive

    async def replay():
        return pending.pop() if pending else await receive()

    return size, replay


def client_key(request: Request, api_keys: list[str]) -> str:
    """Whose rate-limit buckets a request spends: its tenant (its API key, verified by the front door) and without
    enforced keys its client's address: a bearer string nobody checks is the client's to change at will."""
    if api_keys:
        return "key:" + tenant_of(request, api_keys)
    return "ip:" + (request.client.host if request.client else "unknown")


def log_usage(log: dict, counts: dict) -> None:
    log.update(prompt_tokens=counts["prompt_tokens"], completion_tokens=counts["completion_tokens"],
               cached_tokens=counts["prompt_tokens_details"]["cached_tokens"])


def log_aborted(log: dict, latest: dict[int, RequestOutput]) -> None:
    """A request whose client went away: what it had produced by then (each prompt's latest output)."""
    log["aborted"] = True
    log["finish_reasons"] = [c.finish_reason or "abort" for o in latest.values() for c in o.outputs]
    log_usage(log, usage(sum(len(o.prompt_token_ids) for o in latest.values()),
                         sum(len(c.token_ids) for o in latest.values() for c in o.outputs),
                         sum(o.num_cached_tokens for o in latest.values())))


def log_request(log: dict, started: float, level: int = logging.INFO) -> None:
    """The request's one line in the ``serval.requests`` log, as JSON: method, path, status, request id, and for a
    generation its tokens, queue time, TTFT and finish reasons; latency runs from arrival to the response (for a
    stream, to its end)."""
    trace = log.pop("_trace", None)
    request_log.log(level, json.dumps({**log, "latency_s": round(time.monotonic() - started, 4)}))
    if trace is not None:
        tracing, span = trace
        tracing.finish_request(span, log, started)
