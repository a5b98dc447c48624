"""The front end's check of a grammar: its size against StructuredOutputConfig, before the request is queued.

No grammar library here (xgrammar imports torch, and the server's process has neither): whether a grammar parses
and compiles is the core's to find (engine/structured_output.py), which fails the request alone, and the server
answers 400 naming its field either way.
"""

from __future__ import annotations

import json

from serval.config import StructuredOutputConfig
from serval.errors import RequestError, grammar_error
from serval.sampling_params import StructuredOutputsParams


def check_grammar_size(spec: StructuredOutputsParams, limits: StructuredOutputConfig) -> None:
    """Refuses a grammar past the size limits (a RequestError naming its field and what is wrong)."""

    def refuse(what: str) -> RequestError:
        return grammar_error(spec.kind, what)

    if spec.json is not None:
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        if len(text.encode("utf-8", "surrogatepass")) > limits.max_schema_bytes:
            raise refuse(f"the schema is {len(text)} characters; the limit is {limits.max_schema_bytes} bytes")
        try:
            schema = json.loads(text) if isinstance(spec.json, str) else spec.json
        except (ValueError, RecursionError):
            schema = None  # the compile says what is wrong
        members = _schema_members(schema)
        if members > limits.max_schema_members:
            raise refuse(f"the schema has {members} properties, enum values and anyOf/oneOf/allOf branches; "
                         f"the limit is {limits.max_schema_members}")
    elif spec.regex is not None:
        if len(spec.regex) > limits.max_regex_chars:
            raise refuse(f"the regex is {len(spec.regex)} characters; the limit is {limits.max_regex_chars}")
    elif spec.choice is not None:
        if len(spec.choice) > limits.max_choices:
            raise refuse(f"{len(spec.choice)} choices; the limit is {limits.max_choices}")
        chars = sum(map(len, spec.choice))
        if chars > limits.max_choice_chars:
            raise refuse(f"the choices are {chars} characters together; the limit is {limits.max_choice_chars}")
    elif spec.grammar is not None:
        if len(spec.grammar) > limits.max_grammar_chars:
            raise refuse(f"the grammar is {len(spec.grammar)} characters; the limit is {limits.max_grammar_chars}")


def _schema_members(schema) -> int:
    """Properties, enum values and anyOf/oneOf/allOf branches in the whole schema (what its grammar grows with)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("properties", "enum", "anyOf", "oneOf", "allOf"):
                if isinstance(node.get(key), (dict, list)):
                    count += len(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count
