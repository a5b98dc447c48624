"""Hostile input never costs the server anything: every bad body is a 4xx naming its field (never a 5xx), the
keep-alive connection stays open, /health stays 200, nothing stays queued; and a client cannot dodge the rate limit
by changing an unverified bearer string.

A fuzz table of bad bodies (each sent several times) and a property test (hypothesis) over the request schemas, both
against one real server with a small --max-waiting: a request that leaked a queue slot would leave the server
answering 503 for good after a few."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import Server, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
LOAD_TIMEOUT_S = 900  # two servers loading at once on two shared cores

MODEL = "smollm2-135m-instruct"
MAX_WAITING = 4
REPEATS = 3  # each bad body this many times: more than MAX_WAITING leaks would freeze the server
HI = [{"role": "user", "content": "hi"}]
BIG = 2**64
SURROGATE = "\ud800"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def _servers(tmp_path_factory):
    """Both servers load at once: one with a small queue for the fuzzing, one rate-limited without API keys."""
    logs = tmp_path_factory.mktemp("fuzz-logs")
    with running({"fuzz": Server(["--max-waiting", str(MAX_WAITING)], logs / "fuzz.log"),
                  "limited": Server(["--rate-limit-rpm", "2"], logs / "limited.log")}) as servers:
        yield servers


@pytest.fixture(scope="module")
def fuzz_server(_servers) -> Server:
    return _servers["fuzz"].wait_ready(LOAD_TIMEOUT_S)


@pytest.fixture(scope="module")
def limited_server(_servers) -> Server:
    return _servers["limited"].wait_ready(LOAD_TIMEOUT_S)


# -- the table ---------------------------------------------------------------------------------------------------------
# Wrong values by the kind of field: none of them is valid for a field of that kind. (Null is left out: a sampling
# field left to the model's defaults takes it.)
WRONG = {
    "int": [BIG, -BIG, "many", 1.5, [1], {"a": 1}],
    "opt_int": [BIG, -BIG, "many", 1.5, [1], {"a": 1}],
    "float": ["hot", 1e308, -1e308, float("nan"), [0.5], {"v": 1}],
    "bool": ["maybe", 2, [True], {"a": 1}],
    "str": [5, [1], {"a": "b"}, SURROGATE],
    "dict": [5, "x", [1], {SURROGATE: 1}],
}
DEEP: dict = {}
_inner = DEEP
for _ in range(900):  # below json's own recursion limit, far past any real schema's nesting
    _inner["a"] = {}
    _inner = _inner["a"]
CHAT_FIELDS = {  # field: its kind (the fields both endpoints share, and chat's own)
    "n": "int", "top_k": "int", "min_tokens": "int", "priority": "int",
    "max_tokens": "opt_int", "seed": "opt_int", "max_completion_tokens": "opt_int", "top_logprobs": "opt_int",
    "temperature": "float", "top_p": "float", "presence_penalty": "float", "frequency_penalty": "float",
    "min_p": "float", "repetition_penalty": "float",
    "stream": "bool", "ignore_eos": "bool", "include_stop_str_in_output": "bool", "end_session": "bool",
    "logprobs": "bool", "parallel_tool_calls": "bool",
    "user": "str", "session_id": "str", "guided_regex": "str", "guided_grammar": "str",
    "logit_bias": "dict", "response_format": "dict", "stream_options": "dict", "kv_transfer_params": "dict",
}
COMPLETION_FIELDS = {"logprobs": "opt_int", "echo": "bool", "best_of": "opt_int"}

CASES: list[tuple[str, str, dict | bytes, str | None]] = []  # (name, path, body, the param the error names)
for field, kind in CHAT_FIELDS.items():
    for i, value in enumerate(WRONG[kind]):
        CASES.append((f"chat-{field}-{i}", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, field: value},
                      field))
for field, kind in {**{f: k for f, k in CHAT_FIELDS.items() if f not in ("logprobs", "parallel_tool_calls",
                                                                           "max_completion_tokens", "top_logprobs")},
                    **COMPLETION_FIELDS}.items():
    for i, value in enumerate(WRONG[kind]):
        CASES.append((f"completions-{field}-{i}", "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value},
                      field))

CASES += [
    # Past what the engine's wire carries: each was a 500 that left a queue slot taken for good.
    ("top_k-2**64", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "top_k": BIG}, "top_k"),
    ("priority-2**64", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "priority": BIG}, "priority"),
    ("min_tokens-2**64-without-max_tokens", "/v1/chat/completions", {"messages": HI, "min_tokens": BIG},
     "min_tokens"),
    ("min_tokens-past-context", "/v1/chat/completions", {"messages": HI, "min_tokens": 10**6}, "min_tokens"),
    ("min_tokens-past-the-prompts-room", "/v1/completions", {"prompt": "hi " * 100, "max_tokens": None,
                                                             "min_tokens": 8190}, "min_tokens"),
    ("stop_token_ids-2**64", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "stop_token_ids": [BIG]},
     "stop_token_ids.0"),
    ("stop_token_ids-outside-vocab", "/v1/chat/completions",
     {"messages": HI, "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [99999]}, "stop_token_ids"),
    ("stop_token_ids-negative", "/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("prompt-token-2**64", "/v1/completions", {"prompt": [[BIG]]}, "prompt"),
    ("prompt-token-outside-vocab", "/v1/completions", {"prompt": [49152]}, "prompt"),
    ("kv_transfer_params-2**64", "/v1/chat/completions",
     {"messages": HI, "max_tokens": 4, "kv_transfer_params": {"do_remote_decode": BIG}}, "kv_transfer_params"),
    ("kv_transfer_params-wrong-role", "/v1/completions",
     {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ("guided_json-2**64", "/v1/chat/completions", {"messages": HI, "guided_json": {"minimum": BIG}}, "guided_json"),
    ("seed-2**64", "/v1/completions", {"prompt": "hi", "seed": BIG}, "seed"),
    ("n-null", "/v1/chat/completions", {"messages": HI, "n": None}, "n"),
    ("guided_json-deep", "/v1/chat/completions", {"messages": HI, "guided_json": DEEP}, "guided_json"),
    ("tools-deep", "/v1/chat/completions",
     {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools"),
    ("chat-extra-field-deep", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": DEEP}]},
     "messages.0"),
    ("responses-metadata-deep", "/v1/responses", {"input": "hi", "metadata": DEEP}, "metadata"),
    # Lone surrogates: no text to UTF-8, the tokenizer or the engine's wire.
    ("stop-surrogate", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "stop": [SURROGATE]}, "stop"),
    ("chat-content-surrogate", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": f"a{SURROGATE}b"}], "max_tokens": 4}, "messages.0.content"),
    ("chat-part-surrogate", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "messages.0.content.0.text"),
    ("chat-extra-field-surrogate", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi", "x": {"y": [SURROGATE]}}]}, "messages.0"),
    ("completions-prompt-surrogate", "/v1/completions", {"prompt": SURROGATE, "max_tokens": 4}, "prompt"),
    ("completions-prompts-surrogate", "/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt"),
    ("responses-input-surrogate", "/v1/responses", {"input": SURROGATE, "max_output_tokens": 4}, "input"),
    ("responses-instructions-surrogate", "/v1/responses", {"input": "hi", "instructions": SURROGATE},
     "instructions"),
    ("responses-metadata-surrogate", "/v1/responses", {"input": "hi", "metadata": {"a": SURROGATE}}, "metadata"),
    ("tokenize-surrogate", "/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("tokenize-messages-surrogate", "/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]},
     "messages.0.content"),
    ("tools-surrogate", "/v1/chat/completions",
     {"messages": HI, "tools": [{"type": "function", "function": {"name": SURROGATE}}]}, "tools"),
    ("guided_choice-surrogate", "/v1/chat/completions", {"messages": HI, "guided_choice": [SURROGATE]},
     "guided_choice"),
    # Malformed structures: each was a 500 (AttributeError, TypeError).
    ("tool_choice-function-a-string", "/v1/chat/completions",
     {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice.function"),
    ("tool_choice-function-null", "/v1/chat/completions",
     {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": None}}, "tool_choice.function"),
    ("tool_choice-no-function", "/v1/chat/completions",
     {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ("tool_choice-number", "/v1/chat/completions", {"messages": HI, "tools": [TOOL], "tool_choice": 5},
     "tool_choice"),
    ("tool_choice-unknown-mode", "/v1/chat/completions", {"messages": HI, "tools": [TOOL], "tool_choice": "often"},
     "tool_choice"),
    ("responses-tool_choice-function-a-string", "/v1/responses",
     {"input": "hi", "tools": [{"type": "function", "name": "get_weather"}],
      "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice.function"),
    ("responses-tool_choice-no-name", "/v1/responses",
     {"input": "hi", "tools": [{"type": "function", "name": "get_weather"}], "tool_choice": {"type": "function"}},
     "tool_choice"),
    ("tool_calls-function-a-string", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "f"}]}, *HI]},
     "messages.0.tool_calls.0.function"),
    ("tool_calls-function-null", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": None}]}, *HI]},
     "messages.0.tool_calls.0.function"),
    ("tool_calls-function-name-number", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}, *HI]},
     "messages.0.tool_calls.0.function.name"),
    ("tool_calls-a-string", "/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": "f"}, *HI]},
     "messages.0.tool_calls"),
    ("tools-a-number", "/v1/chat/completions", {"messages": HI, "tools": 5}, "tools"),
    ("tools-no-function", "/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, "tools"),
    ("tools-parameters-a-number", "/v1/chat/completions",
     {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools"),
    ("responses-input_text-number", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ("responses-input_image", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ("responses-content-number", "/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ("responses-role-unknown", "/v1/responses", {"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ("responses-item-type-unknown", "/v1/responses", {"input": [{"type": "frob"}]}, "input[0].type"),
    ("responses-item-a-number", "/v1/responses", {"input": [5]}, "input.0"),
    ("responses-function_call-no-name", "/v1/responses", {"input": [{"type": "function_call", "call_id": "c"}]},
     "input[0].name"),
    ("responses-function_call_output-no-call_id", "/v1/responses",
     {"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ("responses-text-format-unknown", "/v1/responses", {"input": "hi", "text": {"format": {"type": "xml"}}},
     "text.format.type"),
    ("responses-seed-2**64", "/v1/responses", {"input": "hi", "seed": BIG}, "seed"),
    ("responses-max_output_tokens-2**64", "/v1/responses", {"input": "hi", "max_output_tokens": BIG},
     "max_output_tokens"),
    ("responses-previous-unknown", "/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"},
     "previous_response_id"),
    # Content parts: text is read, the rest is refused by name.
    ("chat-image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.0.type"),
    ("chat-audio-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [
         {"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages.0.content.1.type"),
    ("chat-part-text-number", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
    ("chat-part-a-number", "/v1/chat/completions", {"messages": [{"role": "user", "content": [5]}]},
     "messages.0.content.0"),
    ("chat-content-object", "/v1/chat/completions", {"messages": [{"role": "user", "content": {"text": "hi"}}]},
     "messages.0.content"),
    ("chat-message-a-string", "/v1/chat/completions", {"messages": ["hi"]}, "messages.0"),
    ("chat-messages-null", "/v1/chat/completions", {"messages": None}, "messages"),
    ("chat-role-missing", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("best_of-more-than-n", "/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    # Other endpoints and whole bodies.
    ("completions-prompt-nested-garbage", "/v1/completions", {"prompt": [[1, "x"], {"a": [None]}]}, "prompt"),
    ("completions-prompt-null", "/v1/completions", {"prompt": None}, "prompt"),
    ("completions-prompt-empty-inner", "/v1/completions", {"prompt": [[]]}, "prompt"),
    ("model-unknown", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, "model"),
    ("tokenize-both", "/tokenize", {"prompt": "hi", "messages": HI}, "prompt"),
    ("tokenize-prompt-number", "/tokenize", {"prompt": 5}, "prompt"),
    ("detokenize-2**64", "/detokenize", {"tokens": [BIG]}, "tokens"),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [49152]}, "tokens"),
    ("detokenize-strings", "/detokenize", {"tokens": ["a"]}, "tokens.0"),
    ("body-not-json", "/v1/chat/completions", b"{", None),
    ("body-invalid-utf8", "/v1/completions", b"\xff\xfe", None),
    ("body-array", "/v1/completions", b"[]", None),
    ("body-null", "/v1/responses", b"null", None),
    ("body-deeply-nested", "/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ("body-max_tokens-1e400", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    ("body-raw-surrogate-escape", "/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00x"]}', "stop"),
]


def _encode(body: dict | bytes) -> bytes:
    # json.dumps escapes a lone surrogate as "\ud800" (ensure_ascii): the bytes a client's JSON library sends.
    return body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body}).encode()


def _names(param: str | None, field: str) -> bool:
    """The error's param is the field, or a place inside it."""
    return param is not None and (param == field or param.startswith((f"{field}.", f"{field}[")))


def _counters(server: Server) -> tuple[int, int]:
    state = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    return state["num_waiting"], state["num_running"]


def _idle(server: Server) -> bool:
    """Nothing queued or running, in /engine/state and in /metrics alike."""
    return _counters(server) == (0, 0) and server.metrics().get("serval:num_requests_waiting") == 0


def test_fuzz_table_is_all_4xx_and_leaves_nothing_behind(fuzz_server):
    """Every bad body, several times each, on one keep-alive connection: a 4xx naming the field, never a 5xx; the
    connection stays open; /health stays 200; nothing stays queued; and then a good request succeeds on the same
    connection."""
    conn = http.client.HTTPConnection("127.0.0.1", fuzz_server.port, timeout=120)
    conn.connect()
    sock = conn.sock
    statuses: dict[str, int] = {}
    wrong: list[str] = []
    for name, path, body, param in CASES:
        for _ in range(REPEATS):
            conn.request("POST", path, body=_encode(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            assert conn.sock is sock and response.getheader("connection") != "close", f"{name}: connection closed"
            statuses[name] = response.status
            if not 400 <= response.status < 500:
                wrong.append(f"{name}: {response.status} {raw[:200]!r}")
                break
            error = json.loads(raw)["error"]
            if param is not None and not _names(error["param"], param):
                wrong.append(f"{name}: param {error['param']!r}, not {param!r} ({error['message'][:120]})")
                break
        conn.request("GET", "/health")
        health = conn.getresponse()
        health.read()
        assert health.status == 200, f"/health after {name}"
    num_4xx = sum(400 <= s < 500 for s in statuses.values())
    num_5xx = sum(s >= 500 for s in statuses.values())
    print(f"fuzz table: {len(CASES)} cases x {REPEATS}, {num_4xx} 4xx, {num_5xx} 5xx")
    assert not wrong, "\n".join(wrong)
    assert wait_for(lambda: _idle(fuzz_server), timeout=30), _counters(fuzz_server)
    conn.request("POST", "/v1/chat/completions", body=_encode({"messages": HI, "max_tokens": 2}),
                 headers={"Content-Type": "application/json"})
    good = conn.getresponse()
    assert good.status == 200 and conn.sock is sock
    assert json.loads(good.read())["usage"]["completion_tokens"] == 2
    conn.close()


def test_content_parts_are_joined_text(fuzz_server):
    """OpenAI-valid content as a list of text parts (as LangChain and the Agents SDK send it) reads as the text."""
    client = fuzz_server.client()
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
                  {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                               {"type": "text", "text": "of France?"}]}])
    joined = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital\nof France?"}])
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content


def test_best_of_equal_to_n_is_accepted(fuzz_server):
    completion = fuzz_server.client().completions.create(model=MODEL, prompt="Once", max_tokens=2, n=2, best_of=2)
    assert len(completion.choices) == 2


# -- the property test -------------------------------------------------------------------------------------------
_JUNK = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                  st.sampled_from([SURROGATE, "\udfff", "a\ud83d", "", " "]))
JSON = st.recursive(_JUNK, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                    max_leaves=8)
SMALL_MAX_TOKENS = st.integers(min_value=1, max_value=3)  # a valid request stays short
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"])},
                                optional={"content": st.one_of(st.text(max_size=20), JSON,
                                                               st.lists(st.fixed_dictionaries(
                                                                   {"type": st.sampled_from(["text", "image_url"]),
                                                                    "text": st.one_of(st.text(max_size=10), JSON)}),
                                                                   max_size=2)),
                                          "tool_calls": JSON, "name": JSON})
SAMPLING = {field: st.one_of(JSON, st.sampled_from([0, 1, -1, 2, 2**31, 2**63, 2**64, 0.5, 1e9]))
            for field in ["temperature", "top_p", "top_k", "min_p", "n", "seed", "priority", "min_tokens",
                          "stop", "stop_token_ids", "logit_bias", "presence_penalty", "repetition_penalty",
                          "response_format", "tool_choice", "tools", "user", "guided_choice", "best_of"]}
CHAT_BODY = st.fixed_dictionaries({"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JSON),
                                   "max_tokens": SMALL_MAX_TOKENS}, optional=SAMPLING)
COMPLETION_BODY = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), JSON,
                                                             st.lists(st.integers(-5, 50000), max_size=4)),
                                         "max_tokens": SMALL_MAX_TOKENS}, optional=SAMPLING)
RESPONSES_BODY = st.fixed_dictionaries({"input": st.one_of(st.text(max_size=20), JSON, st.lists(
    st.fixed_dictionaries({}, optional={"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                                 "x"]),
                                        "role": st.sampled_from(["user", "assistant", "x"]), "content": JSON,
                                        "call_id": JSON, "name": JSON, "output": JSON}), max_size=2)),
                                        "max_output_tokens": SMALL_MAX_TOKENS},
                                       optional={k: SAMPLING[k] for k in ("temperature", "top_p", "seed", "tools",
                                                                          "tool_choice")})
REQUESTS = st.one_of(st.tuples(st.just("/v1/chat/completions"), CHAT_BODY),
                     st.tuples(st.just("/v1/completions"), COMPLETION_BODY),
                     st.tuples(st.just("/v1/responses"), RESPONSES_BODY),
                     st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={
                         "prompt": JSON, "messages": st.one_of(st.lists(MESSAGE, max_size=2), JSON)})))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(request=REQUESTS)
def test_any_request_is_never_a_5xx(fuzz_server, request):
    path, body = request
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as http:
        r = http.post(path, content=_encode(body), headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (path, body, r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_counters_return_to_zero_after_the_property_test(fuzz_server):
    """Runs after the property test (file order): whatever it sent, nothing stays queued or running."""
    assert wait_for(lambda: _idle(fuzz_server), timeout=30), _counters(fuzz_server)
    assert httpx.get(f"{fuzz_server.url}/health", timeout=10).status_code == 200


# -- rate limits without API keys ----------------------------------------------------------------------------------
def test_rate_limit_without_keys_is_per_client_not_per_bearer_string(limited_server):
    """--rate-limit-rpm 2 and no --api-key: a new unverified "Bearer fake-N" each time is still the same client."""
    statuses = []
    for i in range(4):
        r = httpx.post(f"{limited_server.url}/v1/completions", headers={"Authorization": f"Bearer fake-{i}"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60)
        statuses.append(r.status_code)
    assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429], statuses
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
