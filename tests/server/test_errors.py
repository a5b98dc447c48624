"""Every refusal is an HTTP status a client can act on, with OpenAI's error object as the body."""

from __future__ import annotations

import asyncio
import types

import httpx
import openai
import pytest
from front_end_only import FrontEndOnly

from serval.engine.client import EngineClient
from serval.errors import RequestError
from serval.server.app import create_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = "any",
                        type: str = "invalid_request_error") -> dict:
    """The response has ``status`` and exactly OpenAI's ``{"error": {message, type, param, code}}``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type
    if param != "any":
        assert error["param"] == param, error
    return error


def post(server, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers={**server.headers, **(headers or {})}, timeout=60, **kwargs)


# -- 400: the request is wrong -----------------------------------------------------------------------------------------
BAD_REQUESTS = {  # case: (path, body, the param the error names)
    "temperature-wrong-type": ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    "temperature-too-high": ("/v1/completions", {"prompt": "hi", "temperature": 5}, "temperature"),
    "top_p-zero": ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    "n-zero": ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    "seed-past-int64": ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    "logprobs-too-many": ("/v1/completions", {"prompt": "hi", "logprobs": 30}, "logprobs"),
    "max_tokens-zero": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens-past-context": ("/v1/completions", {"prompt": "hi", "max_tokens": 1_000_000}, "max_tokens"),
    "prompt-empty": ("/v1/completions", {"prompt": ""}, "prompt"),
    "prompt-empty-list": ("/v1/completions", {"prompt": []}, "prompt"),
    "prompt-missing": ("/v1/completions", {"max_tokens": 4}, "prompt"),
    "unknown-field": ("/v1/completions", {"prompt": "hi", "best_of_everything": True}, "best_of_everything"),
    "chat-messages-empty": ("/v1/chat/completions", {"messages": []}, "messages"),
    "chat-max_tokens-past-context": ("/v1/chat/completions", {"messages": HI, "max_tokens": 1_000_000},
                                     "max_tokens"),
    "chat-temperature-negative": ("/v1/chat/completions", {"messages": HI, "temperature": -1}, "temperature"),
    "chat-top_logprobs-too-many": ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 30},
                                   "top_logprobs"),
    "chat-top_logprobs-without-logprobs": ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2},
                                           "top_logprobs"),
    "chat-unknown-role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
                          "messages.0.role"),
    "chat-unknown-field": ("/v1/chat/completions", {"messages": HI, "frobnicate": 1}, "frobnicate"),
    "logit_bias-too-big": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias"),
    "logit_bias-not-a-token-id": ("/v1/completions", {"prompt": "hi", "logit_bias": {"hello": 1}}, "logit_bias"),
    "logit_bias-negative-id": ("/v1/completions", {"prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias"),
    "logit_bias-outside-vocab": ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    "logit_bias-not-a-number": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "up"}}, "logit_bias.5"),
    "chat-logit_bias-too-small": ("/v1/chat/completions", {"messages": HI, "logit_bias": {"5": -101}},
                                  "logit_bias"),
    "chat-response_format-bad-schema": ("/v1/chat/completions",
                                        {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": {"type": "object", "required": 3}}}},
                                        "response_format"),
    "chat-response_format-no-type": ("/v1/chat/completions", {"messages": HI, "response_format": {}},
                                     "response_format.type"),
    # Bounded work per token: at most 16 stop strings of 2048 characters in all (one request of 10,000 slowed
    # every other stream).
    "stop-too-many": ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    "chat-stop-too-many": ("/v1/chat/completions", {"messages": HI, "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    "stop-too-long": ("/v1/completions", {"prompt": "hi", "stop": ["x" * 1025, "y" * 1024]}, "stop"),
    "prompt-too-many": ("/v1/completions", {"prompt": ["a"] * 257, "max_tokens": 1}, "prompt"),
    "tokenize-nothing": ("/tokenize", {}, "prompt"),
    "detokenize-negative-id": ("/detokenize", {"tokens": [-1]}, "tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_400(server, case):
    path, body, param = BAD_REQUESTS[case]
    assert_openai_error(post(server, path, json={"model": MODEL, **body}), 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_json_is_400(server, path):
    r = post(server, path, content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
    error = assert_openai_error(r, 400)
    assert error["code"] == "invalid_json"
    r = post(server, path, content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=5)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1_000_000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=HI)
    assert info.value.code == "model_not_found"


NO_TEXT = types.SimpleNamespace(eos_token_ids={0})  # the front end's tokenizer: the prompts are token ids


class MisleadingFrontEnd(FrontEndOnly):
    """Refuses every request with a message that mentions other fields than the one it names."""

    async def add_request(self, request_id, prompt, params, priority=0, *args):
        raise RequestError("priority", "max_tokens and min_tokens are not at fault, nor the context: priority is")


FRONT_END_REFUSALS = {  # case: (completions body, param, code, message)
    "token-outside-vocab": ({"prompt": [1, 2, 1000]}, "prompt", "invalid_value",
                            "prompt token id 1000 is not in the vocabulary [0, 1000)"),
    "prompt-fills-the-context": ({"prompt": [1] * 64, "max_tokens": 1}, "prompt", "context_length_exceeded",
                                 "prompt is 64 tokens; this model's context is 64 tokens"),
    "max_tokens-past-context": ({"prompt": [1, 2, 3], "max_tokens": 62}, "max_tokens", "context_length_exceeded",
                                "max_tokens=62 plus the prompt's 3 tokens is more than this model's context of 64 "
                                "tokens"),
    "min_tokens-past-the-room": ({"prompt": [1] * 10, "max_tokens": None, "min_tokens": 60}, "min_tokens",
                                 "invalid_value", "min_tokens=60 is more than the 54 tokens this request may generate"),
    "stop_token_ids-outside-vocab": ({"prompt": [1], "stop_token_ids": [1000]}, "stop_token_ids", "invalid_value",
                                     "stop_token_ids: token ids [1000] are not in the vocabulary [0, 1000)"),
    "kv_transfer_params-wrong-role": ({"prompt": [1], "kv_transfer_params": {"do_remote_decode": True}},
                                      "kv_transfer_params", "invalid_value",
                                      "kv_transfer_params.do_remote_decode needs a prefill worker (serve --role "
                                      "prefill); this server's role is both"),
}


def _post_completions(engine: EngineClient, body: dict) -> httpx.Response:
    async def post_it() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://serval") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(post_it())


@pytest.mark.parametrize("case", list(FRONT_END_REFUSALS))
def test_a_refusal_of_the_engines_front_end_is_a_400_with_its_param_and_code(case):
    body, param, code, message = FRONT_END_REFUSALS[case]
    error = assert_openai_error(_post_completions(FrontEndOnly(NO_TEXT), body), 400, param)
    assert (error["code"], error["message"]) == (code, message)


def test_a_refusal_is_named_by_its_field_whatever_its_message_says():
    error = assert_openai_error(_post_completions(MisleadingFrontEnd(NO_TEXT), {"prompt": [1]}), 400, "priority")
    assert error["code"] == "invalid_value"


# -- 404: no such model ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": HI}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_unknown_model_is_404(server, path, body):
    error = assert_openai_error(post(server, path, json={"model": "gpt-17", **body}), 404, "model")
    assert error["code"] == "model_not_found"


# -- 404 and 405: no such route ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("POST", "/v1/embeddings"), ("GET", "/v1/models/x/y")])
def test_unknown_path_is_404(server, method, path):
    r = httpx.request(method, f"{server.url}{path}", json={"model": MODEL}, timeout=10)
    error = assert_openai_error(r, 404, param=None)
    assert error["code"] == "not_found" and f"{method} {path}" in error["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("method, path, allowed", [
    ("DELETE", "/v1/models", "GET, HEAD"),
    ("GET", "/v1/completions", "POST"),
    ("PUT", "/v1/chat/completions", "POST"),
    ("POST", "/health", "GET, HEAD"),
])
def test_wrong_method_is_405_with_allow(server, method, path, allowed):
    r = httpx.request(method, f"{server.url}{path}", timeout=10)
    error = assert_openai_error(r, 405, param=None)
    assert error["code"] == "method_not_allowed" and f"{method} {path}" in error["message"]
    assert set(r.headers["allow"].split(", ")) == set(allowed.split(", "))  # Starlette's order varies by process


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics", "/v1/models", "/engine/state", "/"])
def test_head_answers_what_get_answers_without_a_body(server, path):
    get, head = httpx.get(f"{server.url}{path}", timeout=10), httpx.head(f"{server.url}{path}", timeout=10)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["x-request-id"]


def test_the_openai_client_sees_an_unserved_endpoint_as_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=MODEL, input="hi")
    assert info.value.status_code == 404 and info.value.code == "not_found"
    assert "/v1/embeddings" in info.value.message


# -- 401: API keys ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
])
def test_api_key_required_on_api_routes(guarded, method, path, body):
    url = f"{guarded.url}{path}"
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": guarded.api_key}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        error = assert_openai_error(r, 401, type="authentication_error")
        assert error["code"] == "invalid_api_key"
    if method == "GET":
        assert httpx.get(url, headers=guarded.headers, timeout=30).status_code == 200


def test_openai_client_with_wrong_key_gets_authentication_error(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="sk-wrong").models.list()
    assert [m.id for m in guarded.client().models.list().data] == [MODEL]


def test_health_and_metrics_open_without_protect_flags(guarded):
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{guarded.url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{guarded.url}/version", timeout=10).status_code == 401  # the rest needs the key


# -- 413: body too large ---------------------------------------------------------------------------------------------
def test_body_over_the_limit_is_413(guarded):
    big = {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 1}  # > 4096 bytes
    error = assert_openai_error(post(guarded, "/v1/completions", json=big), 413)
    assert error["code"] == "request_too_large"
    # without a Content-Length (chunked upload) the limit holds too
    payload = httpx.Request("POST", "/", json=big).content
    r = post(guarded, "/v1/completions", content=iter([payload[:2000], payload[2000:]]),
             headers={"Content-Type": "application/json"})
    assert_openai_error(r, 413)
    small = {"model": MODEL, "prompt": "word", "max_tokens": 1}
    assert post(guarded, "/v1/completions", json=small).status_code == 200
    chunked = httpx.Request("POST", "/", json=small).content  # a chunked body under the limit reaches the route
    r = post(guarded, "/v1/completions", content=iter([chunked[:10], chunked[10:]]),
             headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


# -- 429: rate limit per key ---------------------------------------------------------------------------------------
def test_rate_limit_is_429_with_retry_after(guarded):
    other_key = guarded.api_keys[1]  # this test spends only this key's budget
    client = guarded.client(api_key=other_key)
    admitted, limited = 0, None
    for _ in range(30):
        try:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            admitted += 1
        except openai.RateLimitError as exc:
            limited = exc
            break
    assert limited is not None, "30 requests admitted under a 12/minute limit"
    assert admitted >= 12  # the bucket starts full
    retry_after = limited.response.headers["retry-after"]
    assert int(retry_after) >= 1
    error = assert_openai_error(limited.response, 429, type="rate_limit_exceeded")
    assert error["code"] == "rate_limit_exceeded"
    # the limit is per key: the first key is still served
    r = guarded.client().completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert r.choices[0].finish_reason == "length"
