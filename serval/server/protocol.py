"""OpenAI request and response schemas (with vLLM's extra sampling fields), and the OpenAI error object."""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from serval.errors import RequestError
from serval.sampling_params import DEFAULT_MAX_TOKENS, MODEL_DEFAULT_FIELDS, SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """Becomes ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        # A message or param that quotes the request may quote a lone surrogate, which no JSON body can encode.
        message, param = _printable(message), _printable(param)
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(text: str | None) -> str | None:
    return text if text is None or text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


# Integer bounds at the edge: what the engine's wire (msgpack: 64 bits) and its tensors (int32 counts) can carry.
# The model's own limits (its vocabulary, its context) are checked where they are known.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_JSON_DEPTH = 64  # nesting of free JSON (schemas, tools, metadata): far past any real schema's
# max_tokens and its other names (max_completion_tokens, the Responses API's max_output_tokens) at the edge. Whether
# the prompt leaves room for it is the engine's check (prompt_room), once the prompt's length is known.
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
# OpenAI's ranges for temperature and top_p, which chat completions, completions and the Responses API share
# (SamplingParams checks the engine's own: temperature >= 0, uncapped offline).
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]


class RequestModel(BaseModel):
    """A request schema. JSON may carry what no later stage can: a lone UTF-16 surrogate ("\\ud800") is no text to
    UTF-8, the tokenizer or the engine's wire, and an integer past 64 bits fits no wire or tensor. Every field, free
    JSON (tools, schemas, metadata) included, is refused here with its name, before anything is queued."""

    @field_validator("*")
    @classmethod
    def _wire_safe(cls, value, info: ValidationInfo):
        _check_wire_safe(value, info.field_name)
        return value


def _check_wire_safe(value, where: str) -> None:
    """ValueError when a string in ``value`` holds a lone surrogate, an integer needs more than 64 bits, or the
    JSON nests deeper than MAX_JSON_DEPTH (later stages recurse over it). Models inside were checked themselves."""
    stack = [(value, (), 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                raise ValueError(f"{_path_text(where, path)} holds a lone UTF-16 surrogate ({found.group()!a}) at "
                                 f"character {found.start()}: send valid Unicode text")
        elif isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= 2**64 - 1:
                raise ValueError(f"{_path_text(where, path)} is an integer past 64 bits")
        elif isinstance(item, (dict, list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"{_path_text(where, path)} nests more than {MAX_JSON_DEPTH} levels deep")
            if isinstance(item, dict):
                for key, inner in item.items():
                    stack.append((key, (*path, key, "(a key)"), depth + 1))
                    stack.append((inner, (*path, key), depth + 1))
            else:
                stack.extend((inner, (*path, i), depth + 1) for i, inner in enumerate(item))


def _path_text(where: str, path: tuple) -> str:
    steps = [" (a key)" if p == "(a key)" else f"[{p!a}]" for p in path]
    return where + "".join(steps if len(steps) <= 8 else [*steps[:4], "...", *steps[-3:]])


def error_path(error: dict, document) -> list:
    """Where a pydantic error is in the request's JSON: its ``loc`` less the labels that pydantic adds for the
    member of a union it tried (``str``, ``list[int]``, a model's name), which are no field of the request."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    if document is None:
        return loc
    path, node = [], document
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and type(part) is int and -len(node) <= part < len(node):
            node = node[part]
        elif not (i == len(loc) - 1 and error.get("type") == "missing"):  # a field not given is no label
            continue
        path.append(part)
    return path


def reported_error(errors: list[dict], document) -> tuple[list, dict]:
    """(its path in ``document``, the error) of the error to report: the most specific (deepest) one, since each
    member of a union reports one and the member the value was meant for fails deepest."""
    if not errors:
        return [], {"msg": "invalid value", "type": "value_error"}
    error = max(errors, key=lambda e: len(e.get("loc", ())))  # max keeps the first of equals
    return error_path(error, document), error


def parse_as(model: type[BaseModel], value, param: str) -> BaseModel:
    """``value`` validated as ``model``, or an OpenAIError naming the field below ``param`` (``input[0].text``)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        path, error = reported_error(exc.errors(), value)
        where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        raise OpenAIError(f"{where}: {error.get('msg')}", param=where, code="invalid_value") from None


# Content parts of a message: text only (the models served read text); image, audio and file parts are refused.
TEXT_PART_TYPES = ("text", "input_text", "output_text")


class TextPart(RequestModel):
    model_config = ConfigDict(extra="allow")  # e.g. the annotations of an output_text part
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value not in TEXT_PART_TYPES:
            raise ValueError(f"{value!r} parts are not supported: the model reads text only "
                             f"(give parts of type {', '.join(TEXT_PART_TYPES)})")
        return value


class FunctionCall(RequestModel):
    """A call an assistant turn made: its function's name and arguments (JSON text, as OpenAI sends it)."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict = "{}"


class MessageToolCall(RequestModel):
    model_config = ConfigDict(extra="allow")  # e.g. the index a streamed delta carried
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionName(RequestModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(RequestModel):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionName


class StreamOptions(RequestModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # "schema" would shadow a BaseModel attribute
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(RequestModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The request fields that constrain the output (OpenAI's response_format, vLLM's guided_* extras); one at most.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _SamplingFields(RequestModel):
    """Fields both endpoints share; unknown fields are rejected, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: MaxTokens | None = None  # None: up to the context (chat's default, as OpenAI's)
    # None: not given; the model's default then (EngineClient.sampling_defaults), else OpenAI's.
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # int64: more overflows the generator
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # past the vocabulary: off, as 0
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)  # past the context: the engine refuses it
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None  # in the vocabulary: app.py
    include_stop_str_in_output: bool = False
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # Serval's: the conversation this request is a turn of (chat requests fall back on ``user``): its KV is kept
    # after the request for the next turn; ``end_session``: the last turn, let it go.
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    end_session: bool = False
    # Disaggregated prefill/decode (vLLM's name): what a router sends a prefill worker, then a decode worker.
    kv_transfer_params: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def structured_outputs_field(self) -> str | None:
        """The one field that constrains this request's output, if any; a RequestError when several do."""
        fields = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            fields.insert(0, "response_format")
        if len(fields) > 1:
            raise RequestError(fields[0], f"{fields[0]} and {fields[1]} both constrain the output; give one")
        return fields[0] if fields else None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        field_name = self.structured_outputs_field
        if field_name is None:
            return None
        if field_name != "response_format":
            return StructuredOutputsParams(**{GUIDED_FIELDS[field_name]: getattr(self, field_name)})
        if self.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.response_format.json_schema is None:
            raise RequestError("response_format", "response_format: type 'json_schema' needs a json_schema object "
                               "with a schema")
        return StructuredOutputsParams(json=self.response_format.json_schema.json_schema)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """This request's SamplingParams: its own values, then ``defaults`` (the model's) for the fields it left out
        (MODEL_DEFAULT_FIELDS), then SamplingParams' own (OpenAI's)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {name: getattr(self, name) for name in MODEL_DEFAULT_FIELDS if getattr(self, name) is not None}
        return SamplingParams(
            **{**(defaults or {}), **given}, n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=_token_id_keys(self.logit_bias), seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            max_tokens=max_tokens, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs(), kv_transfer_params=self.kv_transfer_params,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 scores the prompt: only with echo (serving.py)
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)  # only best_of == n (every sample returned): see _best_of

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        """As vLLM (V1): best_of is not supported; best_of == n asks for nothing more than n, so it passes."""
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of={best_of} is not supported (ranking extra samples by their logprob): leave it "
                             f"out, or set it equal to n ({n})")
        return best_of


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # parts (as LangChain and the Agents SDK send) become one text
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls, as this API returned them
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _join_parts(cls, content):
        """Text parts joined by newlines, as vLLM joins them."""
        return "\n".join(part.text for part in content) if isinstance(content, list) else content

    @model_validator(mode="after")
    def _extra_wire_safe(self):
        for name, value in (self.model_extra or {}).items():
            _check_wire_safe(value, name)
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool = True


class TokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def _token_id_keys(bias: dict[str, float] | None) -> dict | None:
    """JSON's string keys as token ids; a key that is no integer stays a string for SamplingParams to refuse."""
    if bias is None:
        return None
    return {int(k) if k.strip().isdecimal() else k: v for k, v in bias.items()}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
