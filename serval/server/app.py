"""The OpenAI-compatible HTTP server: routes, errors, auth, limits, SSE streaming."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

import serval
from serval.chat import build_chat_prompt
from serval.engine.client import EngineClient, EngineDeadError
from serval.outputs import RequestOutput
from serval.sampling_params import MODEL_DEFAULT_FIELDS
from serval.server import responses as responses_api
from serval.server.config import ServerConfig
from serval.server.limits import RateLimiter
from serval.server.metrics import ServerMetrics
from serval.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    new_id,
    now,
    reported_error,
)
from serval.server.responses import ResponsesRequest, ResponseStore
from serval.server.tools import (
    ToolCallParser,
    ToolError,
    check_tools,
    parse_tool_calls,
    prepare_messages,
    resolve_tool_choice,
    tool_call_grammar,
)
from serval.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("serval.server")
request_log = logging.getLogger("serval.requests")
STATIC = Path(__file__).parent / "static"
POLLED_PATHS = ("/health", "/metrics", "/engine/state")  # probes and the live view: logged at DEBUG, not INFO


@dataclass
class _Choice:
    """One streamed choice's progress: what was sent, why it ended."""

    index: int
    sent: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0
    num_chars: int = 0  # of text sent, the echoed prompt included: where the next token's text_offset starts
    echoed: bool = False
    finish_reason: str | None = None
    filter_checked: int = 0  # the output filter passed the text up to here
    tool_calls: ToolCallParser | None = None  # when the request has tools: splits calls out of the text


# What a GET route also answers: HEAD (load balancers and uptime checks probe /health that way).
READ_METHODS = ["GET", "HEAD"]


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI(title="Serval", version=serval.__version__)
    metrics = ServerMetrics(engine)
    limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
    response_store = ResponseStore()  # /v1/responses kept with store: true, for previous_response_id
    tokenizer = engine.tokenizer
    # admitting: requests past the load check whose first output has not come yet. The engine counts a request
    # only once its add ran (on a task, after a thread hop), so a burst would otherwise all pass the check at once.
    state = {"draining": False, "admitting": 0}
    app.state.engine, app.state.config, app.state.metrics, app.state.flags = engine, config, metrics, state

    # -- errors ---------------------------------------------------------------------------------------------------
    def error_response(err: OpenAIError) -> JSONResponse:
        metrics.http_errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    def engine_dead(exc: EngineDeadError) -> OpenAIError:
        return OpenAIError(str(exc), status=503, type="server_error", code="engine_dead")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        """The engine died under a request that was not streamed (the server exits once every open one is
        answered)."""
        return error_response(engine_dead(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Routing's own errors (no such path: 404, wrong method: 405 with its Allow header), in OpenAI's shape."""
        route = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({route})", 405: f"Method not allowed ({route})"}.get(exc.status_code,
                                                                                              f"{exc.detail} ({route})")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(OpenAIError(message, status=exc.status_code, code=code, headers=exc.headers,
                                          type="server_error" if exc.status_code >= 500 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        """A bug: the client gets a 500 in OpenAI's shape; the traceback still goes to the log (Starlette re-raises
        after this response)."""
        request_id = getattr(request.state, "request_id", None)
        return error_response(OpenAIError(f"internal server error (request id {request_id})", status=500,
                                          type="server_error", code="internal_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        path, first = reported_error(list(exc.errors()), exc.body)
        param = ".".join(map(str, path))
        if first.get("type") == "json_invalid":
            return error_response(OpenAIError(f"invalid JSON body: {first.get('msg')}", code="invalid_json"))
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(OpenAIError(message, param=param or None, code="invalid_value"))

    # -- front door: request id, body size, auth, draining ---------------------------------------------------------
    def refuse(request: Request, path: str) -> OpenAIError | None:
        """Why the front door turns this request away, if it does (the body's size was checked before)."""
        protected = path.startswith(("/v1", "/debug")) or path in ("/tokenize", "/detokenize") or (
            path == "/health" and config.protect_health) or (path == "/metrics" and config.protect_metrics)
        if config.api_keys and protected:
            auth = request.headers.get("authorization", "")
            key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
            if key not in config.api_keys:
                return OpenAIError("invalid or missing API key (send Authorization: Bearer KEY)", status=401,
                                   type="authentication_error", code="invalid_api_key")
        if state["draining"] and path.startswith("/v1") and request.method == "POST":
            return OpenAIError("the server is shutting down", status=503, type="server_error", code="shutting_down")
        return None

    def front_door(inner):
        """A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one runs the route in a task of its own
        and hands every body chunk across a memory stream, a hop per SSE chunk of every stream."""

        async def door(scope, receive, send):
            if scope["type"] != "http":
                return await inner(scope, receive, send)
            started = time.monotonic()
            request = Request(scope, receive)
            request_id = request.headers.get("x-request-id") or new_id("req")
            request.state.request_id = request_id
            path = request.url.path
            # The request's log line, filled in on the way (a streamed generation logs it when the stream ends).
            log = request.state.log = {"request_id": request_id, "method": request.method, "path": path,
                                       "status": None}
            request.state.started = started
            if config.tracing is not None and request.method == "POST" and path.startswith("/v1/"):
                # Ended with the request's log line (a stream's at its end), with its queue/prefill/decode phases.
                log["_trace"] = (config.tracing, config.tracing.start_span(f"POST {path}", request.headers,
                                                                           start_monotonic=started))

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
                length, receive = await _read_chunked_body(request, config.max_body_bytes)
            refusal = None
            if length > config.max_body_bytes:
                refusal = OpenAIError(f"request body is {length} bytes; the limit is {config.max_body_bytes}",
                                      status=413, code="request_too_large")
            refusal = refusal or refuse(request, path)
            try:
                if refusal is not None:
                    await error_response(refusal)(scope, receive, send_marked)
                else:
                    await inner(scope, receive, send_marked)
            except Exception:
                log["status"] = 500
                _log_request(log, started)
                raise
            if not scope["state"].get("logged_by_stream", False):
                _log_request(log, started, logging.DEBUG if path in POLLED_PATHS else logging.INFO)

        return door

    app.add_middleware(front_door)

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
                                            "sampling_defaults": engine.sampling_defaults.values}]}

    @app.api_route("/engine/state", methods=READ_METHODS)
    async def engine_state():
        """The live view's data: batch, queue, KV use."""
        s = engine.snapshot()
        return {**s.__dict__, "max_model_len": engine.max_model_len, "alive": engine.is_alive}

    @app.api_route("/debug/kv", methods=READ_METHODS)
    async def debug_kv():
        """The KV cache now: blocks by tier and state (owned, owned by sessions, cached-free, empty), the prefix
        cache's hit rate, the kept conversation sessions. Needs the API key when the server has one."""
        try:
            return await engine.kv_state()
        except EngineDeadError as exc:
            raise engine_dead(exc) from exc
        except TimeoutError as exc:
            raise OpenAIError("the engine did not answer in time", status=503, type="server_error",
                              code="engine_busy") from exc

    @app.api_route("/", methods=READ_METHODS)
    async def index():
        return FileResponse(STATIC / "index.html")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = await _chat_ids(body.messages, 1)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model)
        vocab = engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- generation --------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        prompts = _completion_prompts(body.prompt)
        if body.max_tokens == 0 and not body.echo:  # as vLLM: there would be nothing to return
            raise OpenAIError("max_tokens=0 generates nothing: it is allowed only with echo: true, to score the prompt",
                              param="max_tokens", code="invalid_value")
        logprobs = body.logprobs
        params = _params(body, body.max_tokens, logprobs)
        if body.echo and logprobs is not None:  # the echoed prompt's tokens get their logprobs too, as in vLLM
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return await _serve(request, body, [(p, p if isinstance(p, str) else None) for p in prompts], params,
                            chat=False, echo=body.echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            check_tools(body.tools)
            tool_choice = resolve_tool_choice(body.tools, body.tool_choice)
        except ToolError as exc:
            raise OpenAIError(str(exc), param=exc.param, code="invalid_value") from exc
        tools = body.tools if tool_choice != "none" else None  # "none": the model is not shown them
        ids = await _chat_ids(body.messages, max_tokens or 1, request, tools)
        params = _params(body, max_tokens, logprobs)
        if tool_choice == "required" or isinstance(tool_choice, dict):  # the grammar makes it call
            if params.structured_outputs is not None:
                raise OpenAIError(f"tool_choice {body.tool_choice!r} and {_constraint_field(body)} both constrain "
                                  "the output; give one", param="tool_choice", code="invalid_value")
            try:
                grammar = tool_call_grammar(tools, tool_choice, body.parallel_tool_calls)
            except ValueError as exc:
                raise OpenAIError(f"tools: {exc}", param="tools", code="invalid_value") from exc
            params = dataclasses.replace(params, structured_outputs=grammar)
        return await _serve(request, body, [(ids, None)], params, chat=True, echo=False, tools=tools is not None)

    @app.delete("/v1/sessions/{session_id}")
    async def end_session(session_id: str):
        """Lets a conversation's kept KV go now (it stays in the prefix cache as free blocks)."""
        engine.end_session(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        _check_model(body.model)
        history = response_store.messages(body.previous_response_id) if body.previous_response_id else []
        turns = responses_api.input_messages(body)
        try:
            chat_body = responses_api.chat_request(body, history, turns)
        except OpenAIError as exc:
            raise responses_api.rename_param(exc) from None
        response = responses_api.new_response(body, f"resp_{uuid.uuid4().hex}", now(),
                                              engine.sampling_defaults.values)
        response["model"] = config.served_model_name

        def keep(done: dict, turn: dict) -> None:
            if body.store:
                response_store.put(done, history + turns + [turn])

        try:
            result = await chat_completions(chat_body, request)
        except OpenAIError as exc:
            raise responses_api.rename_param(exc) from None
        if isinstance(result, StreamingResponse):
            return StreamingResponse(responses_api.stream_events(result.body_iterator, response, keep),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if isinstance(result, Response):  # the client left before the answer (499): nobody reads it
            return result
        done, turn = responses_api.from_chat_completion(result, response)
        keep(done, turn)
        return done

    @app.api_route("/v1/responses/{response_id}", methods=READ_METHODS)
    async def get_response(response_id: str):
        return response_store.response(response_id)

    # -- helpers -------------------------------------------------------------------------------------------------
    def _check_model(model: str | None) -> None:
        if model is not None and model != config.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", status=404, param="model",
                              code="model_not_found")

    def _completion_prompts(prompt) -> list:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise OpenAIError("prompt must not be empty", param="prompt", code="invalid_value")
        return prompts

    async def _chat_ids(messages, max_tokens: int, request: Request | None = None, tools: list[dict] | None = None
                        ) -> list[int]:
        as_dicts = [m.model_dump(exclude_none=True) for m in messages]
        for m in as_dicts:
            if m.get("role") == "developer":
                m["role"] = "system"
            m.setdefault("content", "")
        as_dicts, tools = prepare_messages(as_dicts, tools, tokenizer.chat_template_renders_tools)
        room = engine.max_model_len - max_tokens
        if room <= 0:  # the chat is not at fault: say so, not "the chat is N tokens, more than -M"
            raise OpenAIError(f"max_tokens={max_tokens} leaves no room for the prompt in this model's context of "
                              f"{engine.max_model_len} tokens", param="max_tokens",
                              code="context_length_exceeded")
        try:
            # Rendering and tokenizing a long chat (each try of the sliding window's) is off the event loop.
            prompt = await asyncio.to_thread(build_chat_prompt, tokenizer, as_dicts, room, engine.context_policy,
                                             tools)
            if request is not None and prompt.num_dropped_messages:  # the sliding-window policy says what it did
                request.state.dropped_messages = prompt.num_dropped_messages
            return prompt.token_ids
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages", code="context_length_exceeded"
                              if "context" in str(exc) else "invalid_value") from exc

    def _params(body, max_tokens, logprobs):
        try:
            params = body.sampling_params(max_tokens, logprobs, engine.sampling_defaults.values)
        except ValueError as exc:
            param = str(exc).split()[0].removeprefix("SamplingParams.").rstrip(":")
            if param.startswith("structured_outputs") or param == "response_format":
                param = _constraint_field(body)
            raise OpenAIError(str(exc), param=param, code="invalid_value") from exc
        _check_model_limits(body, params)
        return params

    def _check_model_limits(body, params) -> None:
        """What SamplingParams cannot know: this model's vocabulary and context, and what this server does not do
        yet. (The engine checks them too, and a prompt's exact room; here the error names the field.)"""
        vocab = engine.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise OpenAIError(f"{name}: token ids {outside} are not in the vocabulary [0, {vocab})",
                                  param=name, code="invalid_value")
        if params.min_tokens >= engine.max_model_len:
            raise OpenAIError(f"min_tokens={params.min_tokens} leaves no room for the prompt in this model's context "
                              f"of {engine.max_model_len} tokens", param="min_tokens", code="invalid_value")

    async def _serve(request: Request, body, prompts: list, params, chat: bool, echo: bool, tools: bool = False):
        snapshot = engine.snapshot()
        if snapshot.num_waiting + state["admitting"] >= config.max_waiting:
            raise OpenAIError("the server is overloaded; try again later", status=503, type="server_error",
                              code="overloaded", headers={"Retry-After": "1"})
        if limiter.enabled:
            key = _client_key(request, config.api_keys)
            cost = sum(len(p) if isinstance(p, list) else len(p) // 4 + 1 for p, _ in prompts)
            cost += (256 if params.max_tokens is None else params.max_tokens) * params.n * len(prompts)
            wait = limiter.acquire(key, cost)
            if wait is not None:
                raise OpenAIError("rate limit exceeded for this key", status=429, type="rate_limit_exceeded",
                                  code="rate_limit_exceeded", headers={"Retry-After": str(int(wait))})
        request_id = request.state.request_id
        started = request.state.started
        # A conversation's turn: one prompt, a session id (or, for chat, the end user's id).
        session_id = body.session_id or (body.user if chat else None)
        if len(prompts) != 1:
            session_id = None
        streams = [engine.generate(request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt, params,
                                   priority=body.priority, session_id=session_id, end_session=body.end_session)
                   for i, (prompt, _) in enumerate(prompts)]
        firsts: list = []

        async def start() -> None:
            """Every prompt's first output (ValueError for bad input, before any byte), all prompts added at once."""
            firsts.extend(await _first_outputs(streams))
            refused = next((f.error for f in firsts if f is not None and f.error is not None
                            and f.error.startswith("invalid structured output")), None)
            if refused is not None:  # the core could not compile the grammar (or not in time): the caller's error
                for s in streams:
                    await s.aclose()
                raise ValueError(refused)

        state["admitting"] += 1  # until its first output, when the engine has long counted it
        try:
            if not await _unless_disconnected(request, start()):  # gone before the first token: all are aborted
                request.state.log.update(endpoint="chat" if chat else "completions", stream=body.stream)
                _log_aborted(request.state.log, {})
                return Response(status_code=499)
        except ValueError as exc:
            message = str(exc)
            param = "max_tokens" if "max_tokens" in message else ("messages" if chat else "prompt")
            param = next((f for f in ("min_tokens", "stop_token_ids", "priority", "kv_transfer_params")
                          if message.startswith(f)), param)
            if message.startswith("invalid structured output"):
                param = _constraint_field(body)
            code = "context_length_exceeded" if "context" in message else "invalid_value"
            raise OpenAIError(message, param=param, code=code) from exc
        except EngineDeadError as exc:
            raise engine_dead(exc) from exc
        finally:
            state["admitting"] -= 1
        model = config.served_model_name
        response_id = new_id("chatcmpl" if chat else "cmpl")
        merged = _merge(streams, firsts)
        log = request.state.log
        log.update(endpoint="chat" if chat else "completions", stream=body.stream,
                   sampling={name: getattr(params, name) for name in MODEL_DEFAULT_FIELDS})  # what it got, defaults in
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            log["status"] = 200
            request.state.logged_by_stream = True
            return StreamingResponse(
                _sse(merged, prompts, params, chat, echo, response_id, model, include_usage, started, log, tools),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals: dict[int, RequestOutput] = {}  # each prompt's latest output: its final one once done
        choices: dict[int, _Choice] = {}

        async def collect() -> None:
            async for prompt_index, output in _observe(merged, choices, params.n, started, log):
                finals[prompt_index] = output

        if not await _unless_disconnected(request, collect()):  # aborted (merged's streams end): one line says so
            _log_aborted(log, finals)
            return Response(status_code=499)  # nobody reads it: the status logged for a client that left
        result = _full_response(finals, choices, prompts, params, chat, echo, response_id, model, tools)
        _log_usage(log, result["usage"])
        return result

    async def _observe(merged, choices: dict[int, _Choice], n: int, started: float, log: dict):
        """Applies the output filter and records metrics on the way through; yields (prompt index, output).

        Per choice: one TTFT, then one inter-token latency per later token (a gap that brought several tokens is
        shared among them); per prompt: one end-to-end latency. The same whether or not the response streams."""
        seen: dict[int, tuple[int, float]] = {}  # choice -> (tokens observed, when the last came)
        async for prompt_index, output in merged:
            now_t = time.monotonic()
            arrival = output.metrics.get("arrival_time", started)
            for completion in output.outputs:
                key = prompt_index * n + completion.index
                choice = choices.setdefault(key, _Choice(key))
                if choice.finish_reason is not None:
                    continue
                num_seen, last_t = seen.get(key, (0, now_t))
                new_tokens = len(completion.token_ids) - num_seen
                if new_tokens > 0:
                    if num_seen == 0:
                        metrics.ttft.observe(now_t - arrival)
                        new_tokens -= 1  # any others came with it: no gap
                    for _ in range(new_tokens):
                        metrics.itl.observe((now_t - last_t) / new_tokens)
                    seen[key] = (len(completion.token_ids), now_t)
                # Text before a choice's last safe length is final and was checked: scan only what follows it.
                blocked_at = config.output_filter.find(completion.text, choice.filter_checked)
                if blocked_at is not None:
                    completion.text = completion.text[:blocked_at]
                    completion.finish_reason = "content_filter"
                elif completion.finish_reason is None:  # a word still being written may yet be a blocked one
                    checked = choice.filter_checked
                    safe = checked + config.output_filter.safe_length(completion.text[checked:])
                    completion.text = completion.text[:safe]
                    choice.filter_checked = safe
            if output.finished or all(c.finish_reason == "content_filter" for c in output.outputs):
                metrics.e2e.observe(now_t - arrival)
                if "first_scheduled_time" in output.metrics:
                    metrics.queue_time.observe(output.metrics["first_scheduled_time"] - arrival)
                    log["queue_s"] = round(output.metrics["first_scheduled_time"] - arrival, 4)
                if "first_token_time" in output.metrics:
                    log["ttft_s"] = round(output.metrics["first_token_time"] - arrival, 4)
                log["finish_reasons"] = [c.finish_reason for c in output.outputs]
                metrics.prompt_tokens.inc(len(output.prompt_token_ids))
                metrics.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
                for c in output.outputs:
                    metrics.request_success.labels(c.finish_reason or "abort").inc()
                if output.error:
                    raise OpenAIError(output.error, status=500, type="server_error", code="internal_error")
                if not output.finished:
                    output.finished = True
                    engine.abort(output.request_id)
            yield prompt_index, output

    def _full_response(finals, choices, prompts, params, chat, echo, response_id, model, tools) -> dict:
        out_choices = []
        prompt_tokens = completion_tokens = cached = 0
        for prompt_index in sorted(finals):
            output = finals[prompt_index]
            prompt_tokens += len(output.prompt_token_ids)
            cached += output.num_cached_tokens
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                index = prompt_index * params.n + c.index
                if chat:
                    message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
                    content, calls = parse_tool_calls(c.text) if tools else (c.text, [])
                    if calls:
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": [call.to_openai() for call in calls]}
                        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                    out_choices.append({"index": index, "message": message,
                                        "logprobs": _chat_logprobs(tokenizer, c.logprobs or [])
                                        if params.logprobs is not None else None,
                                        "finish_reason": finish_reason})
                else:
                    prompt_text = _echo_text(tokenizer, prompts[prompt_index][1], output) if echo else ""
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = _completion_logprobs(tokenizer, c.logprobs or [], len(prompt_text))
                        if echo:
                            logprobs = _join_logprobs(_prompt_logprobs(tokenizer, output), logprobs)
                    out_choices.append({"index": index, "text": prompt_text + c.text, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason})
        usage = _usage(prompt_tokens, completion_tokens, cached)
        result = {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
                  "model": model, "choices": out_choices, "usage": usage}
        held = [finals[i].kv_transfer_params for i in sorted(finals) if finals[i].kv_transfer_params]
        if held:  # a prefill worker's: where a decode worker fetches the prompt's KV (one prompt)
            result["kv_transfer_params"] = held[0]
        return result

    async def _sse(merged, prompts, params, chat, echo, response_id, model, include_usage, started, log, tools):
        choices: dict[int, _Choice] = {}
        created = now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        prompt_tokens = completion_tokens = cached = 0
        latest: dict[int, RequestOutput] = {}  # each prompt's last output, for the log of a stream cut short

        # Every chunk starts with the same fields: encoded once, not once a token.
        head = json.dumps({"id": response_id, "object": obj, "created": created, "model": model},
                          ensure_ascii=False)[:-1]

        def chunk(choice_list, usage=None) -> str:
            body = f'{head}, "choices": {json.dumps(choice_list, ensure_ascii=False)}'
            if include_usage:
                body += f', "usage": {json.dumps(usage)}'
            return f"data: {body}}}\n\n"

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(prompts) * params.n)])
            async for prompt_index, output in _observe(merged, choices, params.n, started, log):
                latest[prompt_index] = output
                pieces = []
                for c in output.outputs:
                    choice = choices[prompt_index * params.n + c.index]
                    if choice.finish_reason is not None:
                        continue
                    delta = c.text[len(choice.sent):]
                    new_logprobs = (c.logprobs or [])[choice.num_logprobs:]
                    choice.num_tokens = len(c.token_ids)
                    echo_now = echo and not choice.echoed  # the first chunk carries the prompt
                    if not delta and not c.finish_reason and not echo_now:
                        continue  # held back: these tokens' logprobs go with the text that completes them
                    prompt_text = _echo_text(tokenizer, prompts[prompt_index][1], output) if echo_now else ""
                    delta = prompt_text + delta
                    choice.echoed = choice.echoed or echo_now
                    choice.num_logprobs += len(new_logprobs)
                    choice.sent = c.text
                    choice.finish_reason = c.finish_reason
                    lp = None
                    if params.logprobs is not None and chat and new_logprobs:
                        lp = _chat_logprobs(tokenizer, new_logprobs)
                    elif params.logprobs is not None and (new_logprobs or echo_now):
                        lp = _completion_logprobs(tokenizer, new_logprobs, choice.num_chars + len(prompt_text))
                        if echo_now:
                            lp = _join_logprobs(_prompt_logprobs(tokenizer, output), lp)
                    choice.num_chars += len(delta)
                    if chat and tools:
                        piece = _tool_delta(choice, delta, c.finish_reason, lp)
                        if piece is not None:
                            pieces.append(piece)
                    elif chat:
                        pieces.append({"index": choice.index, "delta": {"content": delta} if delta else {},
                                       "logprobs": lp, "finish_reason": c.finish_reason})
                    else:
                        pieces.append({"index": choice.index, "text": delta, "logprobs": lp,
                                       "finish_reason": c.finish_reason})
                if output.finished:
                    prompt_tokens += len(output.prompt_token_ids)
                    cached += output.num_cached_tokens
                    completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                if pieces:
                    yield chunk(pieces)
            usage = _usage(prompt_tokens, completion_tokens, cached)
            if include_usage:
                yield chunk([], usage)
            _log_usage(log, usage)
            _log_request(log, started)
        except (OpenAIError, EngineDeadError) as exc:  # the stream ends with an error event, then [DONE]
            err = exc if isinstance(exc, OpenAIError) else engine_dead(exc)
            log["error"] = err.code
            _log_request(log, started)
            yield f"data: {json.dumps(err.body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: one log line says so
            _log_aborted(log, latest)
            _log_request(log, started)
            raise
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"  # outside the try: a client gone by now was logged as served, not again as aborted

    return app


def _tool_delta(choice: _Choice, text: str, finish_reason: str | None, logprobs) -> dict | None:
    """A streamed chat delta when the request has tools: content as it becomes final, each call whole once its
    closing tag arrives (index, id, name and all its arguments in one delta); None when there is nothing yet."""
    parser = choice.tool_calls = choice.tool_calls or ToolCallParser()
    first = len(parser.calls)
    content, calls = parser.feed(text)
    if finish_reason is not None:
        content += parser.finish()
        if parser.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [call.to_openai(first + i) for i, call in enumerate(calls)]
    if not delta and finish_reason is None and logprobs is None:
        return None
    return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


async def _unless_disconnected(request: Request, work) -> bool:
    """Runs ``work`` (a coroutine) unless the client disconnects first: then cancels it and returns False. A
    non-streamed answer writes nothing until the end, so only the connection tells that its client is gone."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done: set = set()
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in {task, watcher} - done:
            pending.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(watcher, task, return_exceptions=True)
    if task in done:
        task.result()  # its errors are the request's
        return True
    return False


async def anext_or_none(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _first_outputs(streams: list) -> list:
    """Starts every stream at once, so the engine batches their prompts, and returns each one's first output (None
    for a stream that ended without one). An error in any, or cancellation (client gone), ends them all."""
    if len(streams) == 1:  # awaited in place: its add is counted before the next request's load check
        return [await anext_or_none(streams[0])]
    tasks = [asyncio.ensure_future(anext_or_none(s)) for s in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):  # as in _merge: a read in flight must end before its stream closes
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()  # aborts the requests already added
        raise


async def _merge(streams: list, firsts: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams (a completions call with many prompts), tagging each output."""
    if len(streams) == 1:  # the common case: no read task per token
        try:
            if firsts[0] is not None:
                yield 0, firsts[0]
                if not firsts[0].finished:
                    async for output in streams[0]:
                        yield 0, output
        finally:
            await streams[0].aclose()  # aborts the request if it is still running (client gone)
        return
    for i, first in enumerate(firsts):
        if first is not None:
            yield i, first
    pending = {i: s for i, (s, f) in enumerate(zip(streams, firsts)) if f is not None and not f.finished}
    tasks = {asyncio.ensure_future(anext_or_none(s)): i for i, s in pending.items()}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = tasks.pop(task)
                output = task.result()
                if output is None:
                    continue
                yield i, output
                if not output.finished:
                    tasks[asyncio.ensure_future(anext_or_none(streams[i]))] = i
    finally:
        # A read still in flight is inside its stream: cancelling it ends that stream (whose own finally aborts the
        # request), and closing the stream before the read has finished would raise "already running". The wait
        # is shielded: after a client disconnect, anyio cancels every await in this scope again.
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()  # aborts whatever is still running (client gone)


async def _read_chunked_body(request: Request, limit: int):
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


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _client_key(request: Request, api_keys: list[str]) -> str:
    """Whose rate-limit buckets a request spends: its API key once verified (the front door refused any other), and
    without enforced keys its client's address: a bearer string nobody checks is the client's to change at will."""
    if api_keys:
        auth = request.headers.get("authorization", "")
        return "key:" + auth.removeprefix("Bearer ").strip()
    return "ip:" + (request.client.host if request.client else "unknown")


def _log_usage(log: dict, usage: dict) -> None:
    log.update(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
               cached_tokens=usage["prompt_tokens_details"]["cached_tokens"])


def _log_aborted(log: dict, latest: dict[int, RequestOutput]) -> None:
    """A request whose client went away: what it had produced by then (each prompt's latest output)."""
    log["aborted"] = True
    log["finish_reasons"] = [c.finish_reason or "abort" for o in latest.values() for c in o.outputs]
    _log_usage(log, _usage(sum(len(o.prompt_token_ids) for o in latest.values()),
                           sum(len(c.token_ids) for o in latest.values() for c in o.outputs),
                           sum(o.num_cached_tokens for o in latest.values())))


def _log_request(log: dict, started: float, level: int = logging.INFO) -> None:
    """The request's one line in the ``serval.requests`` log, as JSON: method, path, status, request id, and for a
    generation its tokens, queue time, TTFT and finish reasons; latency runs from arrival to the response (for a
    stream, to its end)."""
    trace = log.pop("_trace", None)
    request_log.log(level, json.dumps({**log, "latency_s": round(time.monotonic() - started, 4)}))
    if trace is not None:
        tracing, span = trace
        tracing.finish_request(span, log, started)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tokenizer, logprobs, text_offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        text = _token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({_token_text(tokenizer, t): v for t, v in lp.top.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _echo_text(tokenizer, prompt_text: str | None, output: RequestOutput) -> str:
    """The prompt as echoed: as sent, or decoded when it came as token ids."""
    return prompt_text if prompt_text is not None else tokenizer.decode(output.prompt_token_ids)


def _prompt_logprobs(tokenizer, output: RequestOutput) -> dict:
    """Completions logprobs of the echoed prompt's tokens. The first has none (nothing precedes it): its
    token_logprob and top_logprobs are null, as in OpenAI's and vLLM's responses."""
    ids = output.prompt_token_ids
    entries = list(output.prompt_logprobs or [])
    entries += [None] * (len(ids) - len(entries))  # none at all, or an output cut short in its prompt
    tokens, token_logprobs, top, offsets = [], [], [], []
    # Offsets follow the decoded prompt, so a character split over several tokens starts at its first token.
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    for token_id, lp in zip(ids, entries, strict=True):
        offsets.append(len(detokenizer.text))
        detokenizer.add(token_id)
        tokens.append(_token_text(tokenizer, token_id))
        token_logprobs.append(lp.logprob if lp is not None else None)
        top.append({_token_text(tokenizer, t): v for t, v in lp.top.items()} if lp is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def _chat_logprobs(tokenizer, logprobs) -> dict:
    content = []
    for lp in logprobs:
        text = _token_text(tokenizer, lp.token_id)
        tops = [(_token_text(tokenizer, t), v) for t, v in lp.top.items()]
        content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in tops]})
    return {"content": content}


def _constraint_field(body) -> str:
    """The request field an invalid grammar came from (response_format or a guided_* extra)."""
    try:
        return body.structured_outputs_field or "response_format"
    except ValueError:
        return "response_format"
