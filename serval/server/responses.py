"""The Responses API (``POST /v1/responses``) as a translation of chat completions.

A Responses request becomes a chat completions request (input items -> messages, ``instructions`` -> the system
message, ``text.format`` -> ``response_format``, flat function tools -> chat tools); its result, whole or streamed,
becomes a Response object or the Responses stream's typed events. Responses with ``store`` (OpenAI's default) are
kept in memory, the most recent ``ResponseStore.capacity``, so that ``previous_response_id`` continues a
conversation and ``GET /v1/responses/{id}`` finds one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from serval.sampling_params import SamplingParams
from serval.server.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    FunctionName,
    MaxTokens,
    OpenAIError,
    RequestModel,
    StreamOptions,
    Temperature,
    TextPart,
    TopP,
    parse_as,
    reported_error,
)

# Chat completions' names for the request fields, mapped back to this API's in error messages.
PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format"}


class TextFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesToolChoice(RequestModel):
    """A named function: ``{"type": "function", "name": ...}`` (this API's form) or chat's ``"function": {...}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    name: str | None = None
    function: FunctionName | None = None

    @model_validator(mode="after")
    def _one_name(self):
        if (self.name is None) == (self.function is None):
            raise ValueError('a named tool_choice is {"type": "function", "name": ...}')
        return self

    @property
    def function_name(self) -> str:
        return self.name if self.name is not None else self.function.name


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None  # None: the model's default (as chat's)
    top_p: TopP | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[dict] | None = None
    tool_choice: str | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's extra, as in chat completions


# The input items this API takes, one model each (by their "type"; a message may leave it out).
class InputMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # e.g. the id and status of an output message given back
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: Any  # text, or JSON that is passed on as its text


INPUT_ITEMS = {"message": InputMessage, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem}


class ResponseStore:
    """The latest responses kept with ``store``, each tenant's apart (server/tenancy.py): tenant -> id -> (the
    conversation's messages so far, the Response). Each tenant keeps its latest ``capacity``, so one key's traffic
    never pushes out another's."""

    capacity = 1024

    def __init__(self) -> None:
        self._tenants: dict[str, OrderedDict[str, tuple[list[dict], dict]]] = {}

    def put(self, tenant: str, response: dict, messages: list[dict]) -> None:
        items = self._tenants.setdefault(tenant, OrderedDict())
        items[response["id"]] = (messages, response)
        items.move_to_end(response["id"])
        while len(items) > self.capacity:
            items.popitem(last=False)

    def messages(self, tenant: str, response_id: str) -> list[dict]:
        return list(self._get(tenant, response_id, "previous_response_id")[0])

    def response(self, tenant: str, response_id: str) -> dict:
        return self._get(tenant, response_id, None)[1]

    def _get(self, tenant: str, response_id: str, param: str | None) -> tuple[list[dict], dict]:
        """Another tenant's response is not found, exactly as one that never was."""
        items = self._tenants.get(tenant, {})
        if response_id not in items:
            raise OpenAIError(f"Response with id '{response_id}' not found.", status=404, param=param,
                              code="not_found")
        return items[response_id]


# -- request in ------------------------------------------------------------------------------------------------
def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's own turns as chat messages (without instructions or a previous response's turns)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    for i, raw in enumerate(body.input):
        kind = raw.get("type", "message")
        if kind not in INPUT_ITEMS:
            raise OpenAIError(f"input[{i}].type {kind!r} is not supported (message, function_call, "
                              "function_call_output are)", param=f"input[{i}].type", code="invalid_value")
        item = parse_as(INPUT_ITEMS[kind], raw, f"input[{i}]")
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            output = item.output
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": output if isinstance(output, str) else json.dumps(output)})
    return messages


def chat_request(body: ResponsesRequest, history: list[dict], turns: list[dict]) -> ChatCompletionRequest:
    """The chat completions request that computes this response."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict = {
        "model": body.model, "messages": system + history + turns, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
        "seed": body.seed, "parallel_tool_calls": body.parallel_tool_calls,
        "stream_options": StreamOptions(include_usage=True) if body.stream else None,
    }
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = {"type": text_format.type}
        if text_format.type == "json_schema":
            if text_format.json_schema is None or not text_format.name:
                raise OpenAIError("text.format of type json_schema needs a name and a schema", param="text.format",
                                  code="invalid_value")
            fields["response_format"]["json_schema"] = {"name": text_format.name, "schema": text_format.json_schema,
                                                        "strict": text_format.strict}
    if body.tools is not None:
        fields["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if isinstance(choice, ResponsesToolChoice):
            choice = {"type": "function", "function": {"name": choice.function_name}}
        fields["tool_choice"] = choice
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:  # in chat's names, which rename_param maps back to this API's
        path, error = reported_error(exc.errors(), fields)
        param = ".".join(map(str, path)) or None
        raise OpenAIError(f"{param}: {error.get('msg')}", param=param, code="invalid_value") from None


def _chat_tool(tool: dict, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise OpenAIError(f'tools[{index}] must be {{"type": "function", "name": ..., "parameters": ...}} '
                          "(function tools are the ones supported)", param="tools", code="invalid_value")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def rename_param(error: OpenAIError) -> OpenAIError:
    """A chat completions error, in this API's field names."""
    if error.param in PARAM_NAMES:
        error.param = PARAM_NAMES[error.param]
    elif error.param and error.param.startswith("messages"):
        error.param = "input" + error.param.removeprefix("messages")
    return error


# -- result out ------------------------------------------------------------------------------------------------
def new_response(body: ResponsesRequest, response_id: str, created_at: int,
                 sampling_defaults: dict | None = None) -> dict:
    """A Response with no output yet (status in_progress); its temperature and top_p are those in force: the
    request's, else ``sampling_defaults`` (the model's), else OpenAI's."""
    given = {"temperature": body.temperature, "top_p": body.top_p}
    sampling = SamplingParams(**{**(sampling_defaults or {}), **{k: v for k, v in given.items() if v is not None}})
    text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "model": body.model, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": _tool_choice_out(body.tool_choice) or ("auto" if body.tools else "none"),
        "tools": body.tools or [],
        "text": {"format": text_format}, "previous_response_id": body.previous_response_id, "store": body.store,
        "metadata": body.metadata or {}, "usage": None,
    }


def _tool_choice_out(choice: str | ResponsesToolChoice | None) -> str | dict | None:
    if isinstance(choice, ResponsesToolChoice):
        return {"type": "function", "name": choice.function_name}
    return choice


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def function_call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def finish(response: dict, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
    """Fills in a Response's output, status and usage from the chat completion's."""
    response["output"] = output
    if finish_reason == "length":
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    elif finish_reason == "content_filter":
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "content_filter"}
    else:
        response["status"] = "completed"
    response["usage"] = {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
    return response


def from_chat_completion(completion: dict, response: dict) -> tuple[dict, dict]:
    """(the Response, the assistant's turn as a chat message) of a whole chat completion."""
    choice = completion["choices"][0]
    message = choice["message"]
    output = [message_item(message["content"])] if message.get("content") else []
    output += [function_call_item(call) for call in message.get("tool_calls") or []]
    turn = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return finish(response, output, choice["finish_reason"], completion["usage"]), turn


async def stream_events(chat_sse: AsyncIterator[str], response: dict, on_done) -> AsyncIterator[str]:
    """The Responses stream's typed events from a chat completion's SSE chunks: response.created, then per
    output item its added / delta / done events, then response.completed (or .incomplete, or .failed).
    ``on_done(response, turn)`` runs once the response is complete (to store it)."""
    sequence = 0

    def event(kind: str, **data) -> str:
        nonlocal sequence
        payload = {"type": kind, "sequence_number": sequence, **data}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    output: list[dict] = []
    text_item: dict | None = None
    text = ""
    finish_reason, usage, calls = None, None, []

    def close_text():
        nonlocal text_item
        if text_item is None:
            return []
        index = output.index(text_item)
        part = {"type": "output_text", "text": text, "annotations": []}
        text_item.update(status="completed", content=[part])
        item_id = text_item["id"]
        text_item = None
        return [event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text),
                event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=index, item=output[index])]

    try:
        async for raw in chat_sse:
            if not raw.startswith("data: ") or raw.startswith("data: [DONE]"):
                continue
            chunk = json.loads(raw[len("data: "):])
            if "error" in chunk:
                response.update(status="failed", error={"code": chunk["error"].get("code") or "server_error",
                                                        "message": chunk["error"]["message"]})
                yield event("response.failed", response=response)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    if text_item is None:
                        text_item = message_item("", status="in_progress")
                        output.append(text_item)
                        yield event("response.output_item.added", output_index=len(output) - 1, item=text_item)
                        yield event("response.content_part.added", item_id=text_item["id"],
                                    output_index=len(output) - 1, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=text_item["id"], output_index=len(output) - 1,
                                content_index=0, delta=delta["content"])
                for call in delta.get("tool_calls") or []:
                    for e in close_text():
                        yield e
                    calls.append(call)
                    for e in _function_call_events(event, output, call):
                        yield e
                finish_reason = choice.get("finish_reason") or finish_reason
    finally:  # a client gone mid-stream: closing the chat stream aborts the request
        await chat_sse.aclose()
    for e in close_text():
        yield e
    finish(response, output, finish_reason, usage or {"prompt_tokens": 0, "completion_tokens": 0,
                                                       "total_tokens": 0})
    turn = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    on_done(response, turn)
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                response=response)


def _function_call_events(event, output: list[dict], call: dict) -> list[str]:
    """A tool call's events: it comes whole in one chat delta, so its item is added, filled and done at once."""
    item = function_call_item(call, status="in_progress")
    item["arguments"] = ""
    output.append(item)
    index = len(output) - 1
    arguments = call["function"]["arguments"]
    events = [event("response.output_item.added", output_index=index, item=dict(item)),
              event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=arguments),
              event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=arguments)]
    item.update(arguments=arguments, status="completed")
    events.append(event("response.output_item.done", output_index=index, item=item))
    return events


def now() -> int:
    return int(time.time())
