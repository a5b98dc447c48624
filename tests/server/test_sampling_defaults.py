"""A request that leaves its sampling fields out gets the model's defaults (SmolLM2's preset: temperature 0.2,
top_p 0.9); a request's explicit values always win. Seen through the official client, the request log and
/v1/models, and as behaviour on a server whose defaults are greedy."""

from __future__ import annotations

import json

import pytest
from serverproc import Server, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hi."}]
STORY = [{"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}]
PRESET = {"temperature": 0.2, "top_p": 0.9}
IN_FORCE = {**PRESET, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}  # the rest: OpenAI's


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("sampling-defaults")
    started = {"default": Server([], logs / "default.log", log_level=None),  # what a user gets
               "greedy": Server(["--generation-config", "vllm", "--override-generation-config", '{"temperature": 0}'],
                                logs / "greedy.log")}
    with running(started):
        yield {name: server.wait_ready() for name, server in started.items()}


def logged_sampling(server: Server, request_id: str) -> dict:
    """The sampling a request got, from its line in the serval.requests log."""
    def find():
        for line in server.log().splitlines():
            if "serval.requests: " in line:
                entry = json.loads(line.split("serval.requests: ", 1)[1])
                if entry["request_id"] == request_id and "sampling" in entry:
                    return entry["sampling"]
        return None
    found = wait_for(find, timeout=10)
    assert found is not None, server.log()[-3000:]
    return found


def test_models_and_the_start_line_say_the_defaults_in_force(servers):
    server = servers["default"]
    entry = server.client().models.list().data[0].to_dict()
    assert entry["sampling_defaults"] == PRESET
    start_line = "sampling defaults temperature=0.2 top_p=0.9 (from Serval's preset for smollm2-135m-instruct)"
    assert start_line in server.log()
    # Where the chat template came from, beside them: the embedded GGUF's own.
    assert entry["chat_template"] == "tokenizer.chat_template in the GGUF header"
    assert "serval: chat template: tokenizer.chat_template in the GGUF header" in server.log()
    assert servers["greedy"].client().models.list().data[0].to_dict()["sampling_defaults"] == {"temperature": 0.0}


def test_a_request_without_sampling_fields_gets_the_models_defaults(servers):
    server = servers["default"]
    client = server.client()
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, extra_headers={"X-Request-Id": "left-out"})
    assert logged_sampling(server, "left-out") == IN_FORCE
    stream = client.completions.create(model=MODEL, prompt="The capital city of Korea is", max_tokens=4, stream=True,
                                       extra_headers={"X-Request-Id": "left-out-stream"})
    assert "".join(chunk.choices[0].text for chunk in stream)
    assert logged_sampling(server, "left-out-stream") == IN_FORCE


def test_explicit_values_win(servers):
    server = servers["default"]
    client = server.client()
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=1.0,
                                   extra_headers={"X-Request-Id": "explicit-1.0"})
    assert logged_sampling(server, "explicit-1.0") == {**IN_FORCE, "temperature": 1.0}  # top_p still the model's
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, top_p=1.0,
                              extra_body={"top_k": 5}, extra_headers={"X-Request-Id": "explicit-greedy"})
    assert logged_sampling(server, "explicit-greedy") == {**IN_FORCE, "temperature": 0.0, "top_p": 1.0, "top_k": 5}


def test_responses_get_the_same_defaults(servers):
    server = servers["default"]
    client = server.client()
    left_out = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4,
                                       extra_headers={"X-Request-Id": "responses-left-out"})
    assert (left_out.temperature, left_out.top_p) == (0.2, 0.9)
    assert logged_sampling(server, "responses-left-out") == IN_FORCE
    explicit = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=1.0,
                                       extra_headers={"X-Request-Id": "responses-explicit"})
    assert (explicit.temperature, explicit.top_p) == (1.0, 0.9)
    assert logged_sampling(server, "responses-explicit")["temperature"] == 1.0


def test_greedy_defaults_are_greedy_and_an_explicit_temperature_samples(servers):
    # Behaviour, not a log line: with the defaults at temperature 0, three samples of an open question are the same
    # text, that of an explicit temperature 0; asked at temperature 1.0 (seeded: the same every run), they differ.
    client = servers["greedy"].client()
    left_out = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, n=3)
    texts = {choice.message.content for choice in left_out.choices}
    explicit_greedy = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, temperature=0)
    assert texts == {explicit_greedy.choices[0].message.content}
    sampled = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, n=3, temperature=1.0, seed=7)
    assert len({choice.message.content for choice in sampled.choices}) > 1
