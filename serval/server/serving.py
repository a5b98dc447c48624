"""The OpenAI endpoints' work between a parsed request and its response, as vLLM's OpenAIServingChat and
OpenAIServingCompletion: prompts and sampling parameters, admission (load, rate limits), the engine's streams, the
output filter and metrics on the way, and the rendered answer (render.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serval.chat import build_chat_prompt
from serval.engine.client import EngineClient, EngineDeadError
from serval.errors import RequestError, grammar_refusal
from serval.outputs import RequestOutput
from serval.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, prompt_room
from serval.server import responses as responses_api
from serval.server.errors import engine_dead
from serval.server.limits import RateLimiter
from serval.server.metrics import ServerMetrics
from serval.server.middleware import client_key, log_aborted, log_request, log_usage
from serval.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    new_id,
    now,
)
from serval.server.render import Choice, Rendering, StreamRenderer, full_response
from serval.server.responses import ResponsesRequest, ResponseStore
from serval.server.tenancy import scoped, tenant_of, unscoped
from serval.server.tools import check_tools, prepare_messages, resolve_tool_choice, tool_call_grammar

if TYPE_CHECKING:
    from serval.server.config import ServerConfig

# What the rate limiter charges per choice of a request without max_tokens (it may run to the context's end): an
# answer's typical length, not the context's room, so such a request is not refused for a length it rarely reaches.
UNCAPPED_ANSWER_COST = 256


def answers_request_errors(endpoint):
    """Makes an endpoint answer a RequestError, wherever its check raised it (the request's fields, SamplingParams,
    the chat's length, the engine's front end), as the 400 naming the request's own field, with the error's code."""

    @functools.wraps(endpoint)
    async def endpoint_answering_request_errors(self, body, *args):
        try:
            return await endpoint(self, body, *args)
        except RequestError as exc:
            raise OpenAIError(exc.message, param=request_field(exc.param, body), code=exc.code) from exc

    return endpoint_answering_request_errors


class OpenAIServing:
    """The completions, chat, Responses and tokenizer endpoints over one engine."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: ServerMetrics, flags: dict) -> None:
        self.engine, self.config, self.metrics, self.tokenizer = engine, config, metrics, engine.tokenizer
        # draining: the server is shutting down. admitting: requests past the load check whose first output has
        # not come yet. The engine counts a request only once its add ran (on a task, after a thread hop), so a
        # burst would otherwise all pass the check at once.
        self.flags = flags
        self.limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
        self.response_store = ResponseStore()  # /v1/responses kept with store: true, for previous_response_id

    # -- endpoints -------------------------------------------------------------------------------------------------
    @answers_request_errors
    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        prompts = completion_prompts(body.prompt, self.config.max_prompts_per_request)
        if body.max_tokens == 0 and not body.echo:  # as vLLM: there would be nothing to return
            raise OpenAIError("max_tokens=0 generates nothing: it is allowed only with echo: true, to score the prompt",
                              param="max_tokens", code="invalid_value")
        logprobs = body.logprobs
        params = self.params(body, body.max_tokens, logprobs)
        if body.echo and logprobs is not None:  # the echoed prompt's tokens get their logprobs too, as in vLLM
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return await self.serve(request, body, [(p, p if isinstance(p, str) else None) for p in prompts], params,
                                chat=False, echo=body.echo)

    @answers_request_errors
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        check_tools(body.tools)
        tool_choice = resolve_tool_choice(body.tools, body.tool_choice)
        tools = body.tools if tool_choice != "none" else None  # "none": the model is not shown them
        ids = await self.chat_ids(body.messages, max_tokens, request, tools)
        params = self.params(body, max_tokens, logprobs)
        if tool_choice == "required" or isinstance(tool_choice, dict):  # the grammar makes it call
            if params.structured_outputs is not None:
                raise OpenAIError(f"tool_choice {body.tool_choice!r} and {constraint_field(body)} both constrain "
                                  "the output; give one", param="tool_choice", code="invalid_value")
            # A schema that does not compile comes back from the core as a 400 naming tools (_first_outputs).
            grammar = tool_call_grammar(tools, tool_choice, body.parallel_tool_calls)
            params = dataclasses.replace(params, structured_outputs=grammar)
        return await self.serve(request, body, [(ids, None)], params, chat=True, echo=False, tools=tools is not None)

    async def responses(self, body: ResponsesRequest, request: Request):
        """The Responses API: a chat completion underneath, its answer translated (responses.py)."""
        self.check_model(body.model)
        store, tenant = self.response_store, tenant_of(request, self.config.api_keys)
        history = store.messages(tenant, body.previous_response_id) if body.previous_response_id else []
        turns = responses_api.input_messages(body)
        try:
            chat_body = responses_api.chat_request(body, history, turns)
        except OpenAIError as exc:
            raise responses_api.rename_param(exc) from None
        response = responses_api.new_response(body, f"resp_{uuid.uuid4().hex}", now(),
                                              self.engine.sampling_defaults.values)
        response["model"] = self.config.served_model_name

        def keep(done: dict, turn: dict) -> None:
            if body.store:
                store.put(tenant, done, history + turns + [turn])

        try:
            result = await self.chat(chat_body, request)
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

    def stored_response(self, response_id: str, request: Request) -> dict:
        return self.response_store.response(tenant_of(request, self.config.api_keys), response_id)

    async def end_session(self, session_id: str, request: Request) -> dict:
        """Ends one of the caller's kept sessions; 404 for one it does not have (another key's included)."""
        engine_session_id = scoped(tenant_of(request, self.config.api_keys), session_id)
        kept = (await self.kv_state())["sessions"]["kept"]
        if not any(s["session_id"] == engine_session_id for s in kept):
            raise OpenAIError(f"Session with id '{session_id}' not found.", status=404, code="not_found")
        self.engine.end_session(engine_session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    async def kv_state_for(self, request: Request) -> dict:
        """The KV cache's state as the caller may see it: the counts whole, the kept sessions only its own."""
        tenant = tenant_of(request, self.config.api_keys)
        state = await self.kv_state()
        sessions = state["sessions"]
        kept = [{**s, "session_id": own} for s in sessions["kept"]
                if (own := unscoped(tenant, s["session_id"])) is not None]
        return {**state, "sessions": {**sessions, "kept": kept}}

    async def kv_state(self) -> dict:
        try:
            return await self.engine.kv_state()
        except EngineDeadError as exc:
            raise engine_dead(exc) from exc
        except TimeoutError as exc:
            raise OpenAIError("the engine did not answer in time", status=503, type="server_error",
                              code="engine_busy") from exc

    @answers_request_errors
    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = await self.chat_ids(body.messages, None)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- prompts and parameters ------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", status=404, param="model",
                              code="model_not_found")

    async def chat_ids(self, messages, max_tokens: int | None, request: Request | None = None,
                       tools: list[dict] | None = None) -> list[int]:
        """The chat's prompt through the model's template, in the room ``max_tokens`` leaves in the context."""
        as_dicts = [m.model_dump(exclude_none=True) for m in messages]
        for m in as_dicts:
            if m.get("role") == "developer":
                m["role"] = "system"
            m.setdefault("content", "")
        as_dicts, tools = prepare_messages(as_dicts, tools, self.tokenizer.chat_template_renders_tools)
        max_model_len = self.engine.max_model_len
        room = prompt_room(max_model_len, max_tokens)
        if room <= 0:  # the chat is not at fault: say so, not "the chat is N tokens, more than -M"
            raise OpenAIError(f"max_tokens={max_tokens} leaves no room for the prompt in this model's context of "
                              f"{max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
        # Rendering and tokenizing a long chat (each try of the sliding window's) is off the event loop.
        prompt = await asyncio.to_thread(build_chat_prompt, self.tokenizer, as_dicts, room,
                                         self.engine.context_policy, tools)
        if request is not None and prompt.num_dropped_messages:  # the sliding-window policy says what it did
            request.state.dropped_messages = prompt.num_dropped_messages
        return prompt.token_ids

    def params(self, body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams (RequestError when they are not valid)."""
        params = body.sampling_params(max_tokens, logprobs, self.engine.sampling_defaults.values)
        self.check_min_tokens(params)
        return params

    def check_min_tokens(self, params: SamplingParams) -> None:
        """min_tokens against this model's context, before the prompt is there: a request that could never be served
        is refused before it is admitted. (The engine's front end checks the vocabulary and a prompt's exact room.)"""
        max_model_len = self.engine.max_model_len
        if params.min_tokens >= max_model_len:
            raise OpenAIError(f"min_tokens={params.min_tokens} leaves no room for the prompt in this model's context "
                              f"of {max_model_len} tokens", param="min_tokens", code="invalid_value")

    # -- serving ---------------------------------------------------------------------------------------------------
    async def serve(self, request: Request, body, prompts: list, params: SamplingParams, chat: bool, echo: bool,
                    tools: bool = False):
        """Runs the prompts (each a (prompt, its text as sent or None) pair) and answers: whole, or as a stream."""
        self._admit(request, prompts, params)
        # The engine's id is the server's own: a client's X-Request-Id (kept for the log and the response header)
        # could name another client's request.
        request_id = new_id("req")
        # A conversation's turn: one prompt, a session id (or, for chat, the end user's id), the tenant's own.
        session_id = body.session_id or (body.user if chat else None)
        if len(prompts) != 1:
            session_id = None
        tenant = tenant_of(request, self.config.api_keys)
        if session_id is not None:
            session_id = scoped(tenant, session_id)
        streams = [self.engine.generate(request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt, params,
                                        priority=body.priority, session_id=session_id, end_session=body.end_session,
                                        tenant=tenant)
                   for i, (prompt, _) in enumerate(prompts)]
        firsts = await self._first_outputs(request, body, streams, chat)
        if firsts is None:  # gone before the first token: all are aborted
            return Response(status_code=499)
        shape = Rendering(self.tokenizer, prompts, params, chat, echo, tools, new_id("chatcmpl" if chat else "cmpl"),
                          self.config.served_model_name)
        merged = merge(streams, firsts)
        log, started = request.state.log, request.state.started
        log.update(endpoint="chat" if chat else "completions", stream=body.stream,
                   sampling={name: getattr(params, name) for name in MODEL_DEFAULT_FIELDS})  # what it got, defaults in
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            log["status"] = 200
            request.state.logged_by_stream = True
            return StreamingResponse(self._sse(merged, shape, include_usage, started, log),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals: dict[int, RequestOutput] = {}  # each prompt's latest output: its final one once done
        choices: dict[int, Choice] = {}

        async def collect() -> None:
            async for prompt_index, output in self._observe(merged, choices, params.n, started, log):
                finals[prompt_index] = output

        if not await unless_disconnected(request, collect()):  # aborted (merged's streams end): one line says so
            log_aborted(log, finals)
            return Response(status_code=499)  # nobody reads it: the status logged for a client that left
        # Off the event loop: an echoed prompt's logprobs or n samples' top logprobs are megabytes of JSON, and
        # rendering them took 1.5 s in which no other stream moved (the route encodes it off the loop too: json_answer).
        result = await asyncio.to_thread(full_response, shape, finals)
        log_usage(log, result["usage"])
        return result

    def _admit(self, request: Request, prompts: list, params: SamplingParams) -> None:
        """Load shedding and rate limits: an OpenAIError (503, 429) when this request must wait."""
        # Counted in sequences, as the engine queues them: a request of p prompts with n samples each takes p × n
        # places, all or none.
        num_sequences = len(prompts) * params.n
        if num_sequences > self.config.max_waiting:
            raise OpenAIError(f"{len(prompts)} prompts × n={params.n} is {num_sequences} sequences, more than this "
                              f"server ever queues ({self.config.max_waiting})",
                              param="n" if params.n > 1 else "prompt", code="invalid_value")
        snapshot = self.engine.snapshot()
        if snapshot.num_waiting + self.flags["admitting"] + num_sequences > self.config.max_waiting:
            raise OpenAIError("the server is overloaded; try again later", status=503, type="server_error",
                              code="overloaded", headers={"Retry-After": "1"})
        if self.limiter.enabled:
            key = client_key(request, self.config.api_keys)
            cost = sum(len(p) if isinstance(p, list) else len(p) // 4 + 1 for p, _ in prompts)
            cost += (UNCAPPED_ANSWER_COST if params.max_tokens is None else params.max_tokens) * params.n * len(prompts)
            wait = self.limiter.acquire(key, cost)
            if wait is not None:
                raise OpenAIError("rate limit exceeded for this key", status=429, type="rate_limit_exceeded",
                                  code="rate_limit_exceeded", headers={"Retry-After": str(int(wait))})

    async def _first_outputs(self, request: Request, body, streams: list, chat: bool) -> list | None:
        """Every prompt's first output, all prompts added at once; None when the client left first. Bad input the
        engine found is raised as its RequestError, before any byte of the answer."""
        firsts: list = []

        num_sequences = len(streams) * body.n  # its places in the queue (_admit)
        self.flags["admitting"] += num_sequences  # until the engine counts them, as soon as their adds start

        def added() -> None:
            nonlocal num_sequences
            self.flags["admitting"] -= num_sequences
            num_sequences = 0

        async def start() -> None:
            firsts.extend(await first_outputs(streams, added))
            refusals = [grammar_refusal(f.error) for f in firsts if f is not None and f.error is not None]
            refused = next((r for r in refusals if r is not None), None)
            if refused is not None:  # the core could not compile the grammar (or not in time): the caller's error
                for s in streams:
                    await s.aclose()
                raise refused

        try:
            if not await unless_disconnected(request, start()):
                request.state.log.update(endpoint="chat" if chat else "completions", stream=body.stream)
                log_aborted(request.state.log, {})
                return None
        except RequestError:
            raise
        except ValueError as exc:  # an engine client's refusal that names no field (core_client.py: it cannot cross)
            raise RequestError("prompt", str(exc)) from exc
        except EngineDeadError as exc:
            raise engine_dead(exc) from exc
        finally:
            added()  # if they never started
        return firsts

    async def _observe(self, merged, choices: dict[int, Choice], n: int, started: float, log: dict):
        """Applies the output filter and records metrics on the way through; yields (prompt index, output).

        Per choice: one TTFT, then one inter-token latency per later token (a gap that brought several tokens is
        shared among them); per prompt: one end-to-end latency. The same whether or not the response streams."""
        seen: dict[int, tuple[int, float]] = {}  # choice -> (tokens observed, when the last came)
        metrics, output_filter = self.metrics, self.config.output_filter
        async for prompt_index, output in merged:
            now_t = time.monotonic()
            arrival = output.metrics.get("arrival_time", started)
            for completion in output.outputs:
                key = prompt_index * n + completion.index
                choice = choices.setdefault(key, Choice(key))
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
                blocked_at = output_filter.find(completion.text, choice.filter_checked)
                if blocked_at is not None:
                    completion.text = completion.text[:blocked_at]
                    completion.finish_reason = "content_filter"
                elif completion.finish_reason is None:  # a word still being written may yet be a blocked one
                    checked = choice.filter_checked
                    safe = checked + output_filter.safe_length(completion.text[checked:])
                    completion.text = completion.text[:safe]
                    choice.filter_checked = safe
            if output.finished or all(c.finish_reason == "content_filter" for c in output.outputs):
                self._record_end(output, now_t, arrival, log)
            yield prompt_index, output

    def _record_end(self, output: RequestOutput, now_t: float, arrival: float, log: dict) -> None:
        """A prompt's end (finished, or every choice stopped by the filter): its metrics and log fields."""
        metrics = self.metrics
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
            self.engine.abort(output.request_id)

    async def _sse(self, merged, shape: Rendering, include_usage: bool, started: float, log: dict):
        """The streamed answer: a chunk per output that brings text, an error event if one comes, then [DONE]."""
        renderer = StreamRenderer(shape, include_usage)
        latest: dict[int, RequestOutput] = {}  # each prompt's last output, for the log of a stream cut short
        try:
            if shape.chat:
                yield renderer.role_chunk()
            async for prompt_index, output in self._observe(merged, renderer.choices, shape.params.n, started, log):
                # A prompt's first chunk echoes it, with its tokens' logprobs when asked: megabytes, off the loop.
                heavy = shape.echo and shape.params.logprobs is not None and prompt_index not in latest
                latest[prompt_index] = output
                chunk = (await asyncio.to_thread(renderer.add, prompt_index, output) if heavy
                         else renderer.add(prompt_index, output))
                if chunk is not None:
                    yield chunk
            counts = renderer.usage()
            if include_usage:
                yield renderer.chunk([], counts)
            log_usage(log, counts)
            log_request(log, started)
        except (OpenAIError, EngineDeadError) as exc:  # the stream ends with an error event, then [DONE]
            err = exc if isinstance(exc, OpenAIError) else engine_dead(exc)
            log["error"] = err.code
            log_request(log, started)
            yield f"data: {json.dumps(err.body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: one log line says so
            log_aborted(log, latest)
            log_request(log, started)
            raise
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"  # outside the try: a client gone by now was logged as served, not again as aborted


async def json_answer(result: dict | Response) -> Response:
    """An endpoint's answer as a response, a dict JSON-encoded on a worker thread: FastAPI would encode it on the
    event loop (and walk it twice, jsonable_encoder first), megabytes for logprobs."""
    return result if isinstance(result, Response) else await asyncio.to_thread(JSONResponse, result)


def completion_prompts(prompt, max_prompts: int) -> list:
    """A completions request's prompts: one text, one list of token ids, or a list of either (at most
    ``max_prompts``)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise OpenAIError("prompt must not be empty", param="prompt", code="invalid_value")
    if len(prompts) > max_prompts:
        raise OpenAIError(f"prompt: at most {max_prompts} prompts in one request, got {len(prompts)}",
                          param="prompt", code="invalid_value")
    return prompts


def constraint_field(body) -> str:
    """The request field an invalid grammar came from (response_format or a guided_* extra)."""
    try:
        return body.structured_outputs_field or "response_format"
    except ValueError:
        return "response_format"


def request_field(param: str | None, body) -> str | None:
    """The request's own name for a field a RequestError names by the engine's name: a grammar
    (SamplingParams.structured_outputs) is the field it came from, the tools for a tool choice's; a chat's prompt is
    its messages."""
    if param == "structured_outputs.tool_calls":
        return "tools"
    if param is not None and param.startswith("structured_outputs"):
        return constraint_field(body)
    if param == "prompt" and isinstance(body, ChatCompletionRequest):
        return "messages"
    return param


async def unless_disconnected(request: Request, work) -> bool:
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


async def first_outputs(streams: list, added) -> list:
    """Starts every stream at once, so the engine batches their prompts, and returns each one's first output (None
    for a stream that ended without one). An error in any, or cancellation (client gone), ends them all. ``added()``
    is called once every add has started, when the engine counts their sequences as waiting."""
    tasks = [asyncio.ensure_future(anext_or_none(s)) for s in streams]
    try:
        await asyncio.sleep(0)  # each task runs to its first suspension, inside its add, which counts it by then
        added()
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):  # as in merge: a read in flight must end before its stream closes
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()  # aborts the requests already added
        raise


async def merge(streams: list, firsts: list) -> AsyncIterator[tuple[int, RequestOutput]]:
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
