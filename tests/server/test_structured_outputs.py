"""Structured outputs through the server with the official client, in the default dtype: response_format
json_schema and json_object, vLLM's guided_* extras, streaming and not; a bad schema or regex is a 400 that names
it, and a request running beside it finishes untouched."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"type": "array", "items": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                       "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "temperature_c", "conditions"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris today? Answer in JSON."}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(default_dtype_server):
    return default_dtype_server.client()


def test_response_format_text_changes_nothing(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_json_schema_outputs_validate_streaming_and_not_greedy_and_sampled(client):
    for temperature, seed in ((0, None), (1.0, 7)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=temperature,
                                           seed=seed, response_format=_schema_format(WEATHER))
        assert r.choices[0].finish_reason == "stop"
        content = r.choices[0].message.content
        jsonschema.validate(json.loads(content), WEATHER)
        stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=temperature,
                                                seed=seed, response_format=_schema_format(WEATHER), stream=True)
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == content  # the same request, streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_and_the_guided_extras(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with a JSON object with the key "answer": is the sky blue?'}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    choice = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0,
                                            extra_body={"guided_choice": ["sunny", "rainy"]})
    assert choice.choices[0].message.content in ("sunny", "rainy")
    regex = client.completions.create(model=MODEL, prompt="Paris postcode:", max_tokens=10, temperature=0,
                                      extra_body={"guided_regex": "75[0-9]{3}"})
    assert re.fullmatch("75[0-9]{3}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    schema = client.completions.create(model=MODEL, prompt="Weather report as JSON:", max_tokens=120,
                                       temperature=0, extra_body={"guided_json": WEATHER})
    jsonschema.validate(json.loads(schema.choices[0].text), WEATHER)
    grammar = client.completions.create(model=MODEL, prompt="Grade:", max_tokens=10, temperature=0,
                                        extra_body={"guided_grammar": 'root ::= ("A" | "B" | "C") ("+" | "-")?'})
    assert re.fullmatch("[ABC][+-]?", grammar.choices[0].text)


def test_a_bad_schema_or_regex_is_a_400_naming_it_and_the_batch_goes_on(client):
    finished = {}

    def long_request():  # runs while the bad ones are refused
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0,
                                      extra_body={"ignore_eos": True})
        finished["text"] = r.choices[0].text
        finished["reason"] = r.choices[0].finish_reason

    runner = threading.Thread(target=long_request)
    runner.start()
    bad = [
        (dict(response_format=_schema_format({"type": "object", "properties": {"x": {"type": "frobnicate"}}})),
         "response_format", "frobnicate"),
        (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex", "parenthesis"),
        (dict(extra_body={"guided_grammar": "root ::= nothing_here"}), "guided_grammar", "nothing_here"),
        (dict(extra_body={"guided_choice": []}), "guided_choice", "choice"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "guided_regex", "both"),
        (dict(response_format={"type": "yaml"}), None, "json_schema"),
    ]
    for kwargs, param, words in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, **kwargs)
        assert info.value.status_code == 400
        if param is not None:
            assert info.value.param == param, (kwargs, info.value.message)
        assert words in info.value.message, (kwargs, info.value.message)
    runner.join(120)
    assert finished["reason"] == "length" and finished["text"]
    alone = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == finished["text"]
