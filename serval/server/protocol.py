"""OpenAI request and response schemas (with vLLM's extra sampling fields), and the OpenAI error object."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serval.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """Becomes ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # "schema" would shadow a BaseModel attribute
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The request fields that constrain the output (OpenAI's response_format, vLLM's guided_* extras); one at most.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _SamplingFields(BaseModel):
    """Fields both endpoints share; unknown fields are rejected, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None: not given; the model's default then (EngineClient.sampling_defaults), else OpenAI's.
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64: more overflows the generator
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0
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
        """The one field that constrains this request's output, if any; ValueError when several do."""
        fields = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            fields.insert(0, "response_format")
        if len(fields) > 1:
            raise ValueError(f"{fields[0]} and {fields[1]} both constrain the output; give one")
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
            raise ValueError("response_format: type 'json_schema' needs a json_schema object with a schema")
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
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, as this API returned them
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
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
