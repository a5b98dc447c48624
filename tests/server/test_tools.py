"""Tool calling in chat completions with the official client, in the default dtype: a required or named choice is
enforced by the grammar and parsed into tool_calls (streamed as OpenAI streams them, finish_reason "tool_calls");
tool results go back through the template; "none" hides the tools; bad tool requests are 400s. And the parts
alone: the Hermes-format parser, streamed or whole, and the prompt a template gets with and without tool
support."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
from real_model import requires_model

from serval.server.tools import ToolCallParser, parse_tool_calls, prepare_messages, resolve_tool_choice

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


# -- the parts alone ------------------------------------------------------------------------------------------------
def test_the_parser_splits_content_and_calls_the_same_streamed_or_whole():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id

    parser = ToolCallParser()  # one character at a time: no partial tag ever leaks into the content
    streamed_content, streamed_calls = "", []
    for ch in text:
        piece, done = parser.feed(ch)
        assert "<" not in piece or piece.startswith("Let")
        streamed_content += piece
        streamed_calls += done
    streamed_content += parser.finish()
    assert streamed_content.strip() == content
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]

    assert parse_tool_calls("no calls <tool_ here") == ("no calls <tool_ here", [])
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>")[1] == []  # stays content
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}')[1] == []  # cut off: stays content


def test_tool_choice_is_checked_against_the_tools():
    assert resolve_tool_choice(TOOLS, None) == "auto" and resolve_tool_choice(None, None) == "none"
    assert resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}) == {"name": "get_time"}
    for tools, choice in ((TOOLS, {"type": "function", "function": {"name": "nope"}}), (None, "required"),
                          (TOOLS, "sometimes")):
        with pytest.raises(ValueError):
            resolve_tool_choice(tools, choice)


@requires_model
def test_templates_with_and_without_tool_support_get_the_tools_and_the_call_history(smollm):
    _, tokenizer = smollm("float32")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    # SmolLM2's template knows only roles and text: tools go into the system prompt, calls and results as text.
    assert not tokenizer.chat_template_renders_tools
    messages, template_tools = prepare_messages(history, TOOLS, False)
    text = tokenizer.render_chat(messages, tools=template_tools)
    assert template_tools is None and '"name": "get_time"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in text
    # A template that renders tools gets them, and the messages, as they are.
    native = copy.copy(tokenizer)
    native.hf_tokenizer = copy.copy(tokenizer.hf_tokenizer)
    native.chat_template = native.hf_tokenizer.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}{{ '\\n' }}{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}{% endfor %}{{ '\\n' }}{% endfor %}")
    assert native.chat_template_renders_tools
    messages, template_tools = prepare_messages(history, TOOLS, True)
    assert native.render_chat(messages, add_generation_prompt=False, tools=template_tools) == (
        "TOOL get_weather\nTOOL get_time\nuser: Weather in Paris?\nassistant: CALL get_weather\n"
        "tool: 18 C, sunny\n")


# -- through the server ---------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def client(default_dtype_server):
    return default_dtype_server.client()


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_required_and_named_choices_call_a_tool_with_valid_arguments(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=100, temperature=0)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) >= 1
        for call in message.tool_calls:
            _check_call(call)
        if isinstance(choice, dict):
            assert [c.function.name for c in message.tool_calls] == ["get_time"]
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=100, temperature=0.9, seed=5)
    assert len(one.choices[0].message.tool_calls) == 1
    _check_call(one.choices[0].message.tool_calls[0])


@pytest.mark.slow
def test_streamed_tool_calls_equal_the_whole_response(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta_call.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta_call.id or call["id"]
            call["name"] += delta_call.function.name or ""
            call["arguments"] += delta_call.function.arguments or ""
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert all(calls[i]["id"].startswith("call_") for i in calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.slow
def test_tool_results_go_back_and_none_hides_the_tools(client):
    call = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=100, temperature=0)
    message = call.choices[0].message
    follow_up = ASK + [message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > call.usage.prompt_tokens  # the call and its result are in the prompt
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0)
    hidden = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert hidden.choices[0].message.content == plain.choices[0].message.content
    assert call.usage.prompt_tokens > plain.usage.prompt_tokens  # "required" shows them


@pytest.mark.slow
def test_bad_tool_requests_are_400s(client):
    bad = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=[{"type": "retrieval"}]), "tools", "tools[0]"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
         "both constrain"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
              tool_choice="required"), "tools", "frobnicate"),
    ]
    for kwargs, param, words in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, **kwargs)
        assert info.value.param == param and words in info.value.message, (kwargs, info.value.message)
