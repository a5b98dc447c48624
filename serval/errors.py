"""RequestError: a request's bad input, raised where the check is, naming the field at fault and the kind of fault.
The server answers it as a 400 with that param and code (server/serving.py); an offline caller sees a ValueError.

A grammar the engine core could not compile comes back as text (an output's ``error``: the core may run in another
process), so that text is written by grammar_error and read back by grammar_refusal, both here.
"""

from __future__ import annotations

# OpenAI's error codes for bad input.
INVALID_VALUE = "invalid_value"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt, or the prompt and max_tokens, past the context
GRAMMAR_ERROR_PREFIX = "invalid structured output"


class RequestError(ValueError):
    """Bad input in one request. ``param``: the field at fault by the engine's name for it (``max_tokens``,
    ``prompt``, ``structured_outputs.json``; None when no one field is); ``code``: OpenAI's code for the fault."""

    def __init__(self, param: str | None, message: str, code: str = INVALID_VALUE) -> None:
        super().__init__(message)
        self.param, self.code, self.message = param, code, message

    def __reduce__(self):  # pickled as its fields: ValueError's default would rebuild it from the message alone
        return type(self), (self.param, self.message, self.code)


def grammar_error(kind: str, what: str) -> RequestError:
    """A grammar refused (its size, its syntax, its compile); ``kind`` is the StructuredOutputsParams field set."""
    return RequestError(f"structured_outputs.{kind}", f"{GRAMMAR_ERROR_PREFIX} {kind}: {what}")


def grammar_refusal(error: str) -> RequestError | None:
    """The grammar_error whose text an output's ``error`` is, or None for another error."""
    if not error.startswith(GRAMMAR_ERROR_PREFIX + " "):
        return None
    kind = error.removeprefix(GRAMMAR_ERROR_PREFIX + " ").split(":", 1)[0]
    return RequestError(f"structured_outputs.{kind}", error)


class ModelFileError(ValueError):
    """A model's files cannot be served: one line naming the file and what is wrong with it (empty, cut short, not
    the format its name says, an architecture Serval does not run, no tokenizer). The command line prints it without
    a traceback and exits non-zero; an engine core that meets one while loading sends it back as it is."""
