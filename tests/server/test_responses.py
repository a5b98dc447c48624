"""The Responses API (/v1/responses) with the official client, in the default dtype: text and message-list input
with instructions, the same answer as chat completions; streaming events that add up to the response; text.format
for structured output; function tools and their outputs; previous_response_id and GET of a stored response;
errors in this API's own field names."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital city of Korea?"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population_millions": {"type": "number", "minimum": 0, "maximum": 40}},
        "required": ["city", "population_millions"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                               "required": ["city"]}}


@pytest.fixture(scope="module")
def client(default_dtype_server):
    return default_dtype_server.client()


def test_text_input_with_instructions_answers_as_chat_completions_does(client):
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one sentence.",
                                max_output_tokens=30, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}])
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == chat.choices[0].message.content and "Seoul" in r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence."

    items = client.responses.create(model=MODEL, max_output_tokens=30, temperature=0, input=[
        {"role": "developer", "content": "Answer in one sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == r.output_text

    short = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_add_up_to_the_response(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == text
    final = events[-1].response
    assert final.output_text == text and final.status == "completed" and final.usage.output_tokens > 0


def test_text_format_json_schema_gives_valid_json(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, input="Describe Seoul as JSON.", max_output_tokens=80, temperature=0,
                      text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            text = events[-1].response.output_text
        else:
            text = client.responses.create(**kwargs).output_text
        jsonschema.validate(json.loads(text), CITY)


def test_function_tools_and_their_outputs_continue_by_previous_response_id(client, default_dtype_server):
    first = client.responses.create(model=MODEL, input="What is the weather in Seoul?", tools=[WEATHER_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)

    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "21 C and sunny"}], max_output_tokens=30, temperature=0)
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turns are in the prompt

    fetched = httpx.get(f"{default_dtype_server.url}/v1/responses/{second.id}", timeout=10).json()
    assert fetched["id"] == second.id and fetched["output"][0]["type"] in ("message", "function_call")
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert httpx.get(f"{default_dtype_server.url}/v1/responses/{unstored.id}", timeout=10).status_code == 404
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id, max_output_tokens=3)
    assert info.value.param == "previous_response_id"

    streamed = list(client.responses.create(model=MODEL, input="What is the weather in Seoul?",
                                            tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=60,
                                            temperature=0, parallel_tool_calls=False, stream=True))
    added = [e for e in streamed if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments  # greedy: the same call as the whole response


def test_errors_name_this_apis_fields(client):
    bad = [
        (dict(input=[{"type": "image", "url": "x"}]), "input[0].type"),
        (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}),
         "text.format"),
        (dict(input="Hi", max_output_tokens=0), "max_output_tokens"),
        (dict(input="Hi", tools=[{"type": "web_search"}]), "tools"),
        (dict(input="Hi", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, **kwargs)
        assert info.value.param == param, (kwargs, info.value.message)
