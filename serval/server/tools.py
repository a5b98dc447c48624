"""Tool calling in chat completions: tools into the prompt, tool calls out of the text, and the grammar that
enforces a required or named tool choice.

Calls are written in the Hermes format that tool-trained open models use (what vLLM's `hermes` parser reads):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call. A chat template that
renders tools itself gets them (and the tool-call and tool messages) as they are; for one that does not (SmolLM2,
Gemma 3), the tools are described in the system prompt, past calls are written back as such blocks, and tool
results go to the model as user turns in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from serval.errors import RequestError
from serval.sampling_params import StructuredOutputsParams, ToolCallsGrammar
from serval.server.protocol import NamedToolChoice

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def resolve_tool_choice(tools: list[dict] | None, tool_choice: str | NamedToolChoice | dict | None) -> str | dict:
    """"none", "auto", "required" or a named function ({"name": ...}); checks it against the tools. A dict is
    read as a NamedToolChoice (the request schema's)."""
    functions = {t["function"]["name"] for t in tools or []}
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or a function, got "
                               f"{tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise RequestError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    try:
        name = NamedToolChoice.model_validate(tool_choice).function.name
    except ValueError:
        shape = '{"type": "function", "function": {"name": ...}}'
        raise RequestError("tool_choice", f"a named tool_choice is {shape}") from None
    if name not in functions:
        raise RequestError("tool_choice", f"tool_choice names function {name!r}, which is not among the tools "
                           f"({', '.join(sorted(functions)) or 'none'})")
    return {"name": name}


def check_tools(tools: list[dict] | None) -> None:
    seen = set()
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError("tools", f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError("tools", f"tools[{i}].function.name must be a string of 1 to 64 characters")
        if name in seen:
            raise RequestError("tools", f"tools[{i}]: function {name!r} is given twice")
        seen.add(name)
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise RequestError("tools", f"tools[{i}].function.parameters must be a JSON schema object")


# -- into the prompt -------------------------------------------------------------------------------------------
def prepare_messages(messages: list[dict], tools: list[dict] | None, template_renders_tools: bool
                     ) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template): as given when the template renders tools, else rewritten in the
    Hermes format for a template that knows only roles and text."""
    if template_renders_tools:
        return messages, tools or None
    out: list[dict] = []
    if tools:
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + tools_prompt(tools)})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": tools_prompt(tools)})
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call.get("function", {})) for call in message["tool_calls"]]
            text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}  # one turn per batch
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    return out, None


def tools_prompt(tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions to answer. These are the functions, one JSON signature per line:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            "To call one, answer with its name and arguments as JSON inside <tool_call></tool_call> tags:\n"
            f'{CALL_START}\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n{CALL_END}')


def _call_block(function: dict) -> str:
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass  # written back as the string it was
    return f"{CALL_START}\n{json.dumps({'name': function.get('name'), 'arguments': arguments})}\n{CALL_END}"


# -- the grammar of a required or named choice ------------------------------------------------------------------
def tool_call_grammar(tools: list[dict], choice: str | dict, parallel: bool) -> StructuredOutputsParams:
    """One call block (several, with parallel_tool_calls, unless a function is named) whose JSON is a call of
    one of the functions with arguments that follow its parameters schema (the engine core writes the grammar)."""
    functions = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters") or {"type": "object"}}
                 for t in tools if isinstance(choice, str) or t["function"]["name"] == choice["name"]]
    return StructuredOutputsParams(tool_calls=ToolCallsGrammar(functions, CALL_START, CALL_END,
                                                               repeat=parallel and isinstance(choice, str)))


# -- out of the text -------------------------------------------------------------------------------------------
class ToolCallParser:
    """Splits generated text into content and tool calls as it streams: content passes through at once, except a
    tail that may be the start of a call tag; a call comes out whole when its closing tag arrives. A block that is
    not a JSON call with a name stays content."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content that is final, calls completed) after ``text``."""
        self._pending += text
        content, calls = "", []
        while True:
            if not self._in_call:
                start = self._pending.find(CALL_START)
                if start < 0:
                    keep = _partial_tag_length(self._pending, CALL_START)
                    content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content += self._pending[:start]
                self._pending = self._pending[start + len(CALL_START):]
                self._in_call = True
            end = self._pending.find(CALL_END)
            if end < 0:
                break
            block, self._pending = self._pending[:end], self._pending[end + len(CALL_END):]
            self._in_call = False
            call = _parse_call(block)
            if call is None:
                content += CALL_START + block + CALL_END
            else:
                calls.append(call)
        self.calls += calls
        if self.calls and not content.strip():
            content = ""  # the newlines between calls are not content
        return content, calls

    def finish(self) -> str:
        """Content still held back when the text ends (an unclosed call stays text)."""
        rest = (CALL_START if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return "" if self.calls and not rest.strip() else rest


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: content is None when only calls were written."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    content = (content + parser.finish()).strip() if parser.calls else content + parser.finish()
    return (content or None) if parser.calls else content, parser.calls


def _parse_call(block: str) -> ToolCall | None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False))


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
