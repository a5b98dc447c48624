"""The messages between the engine's front end and its core process (engine/core_process.py): one dataclass per kind.

Commands go from the front end to the core, replies come back. On the wire a message is one msgpack array, its class
name then its fields in the order the class declares them; a nested dataclass (an EngineCoreRequest, its
SamplingParams, an EngineCoreOutput, TokenLogprobs, the core's counters) is an array of its fields in the same way, and
an enum is its value. The field types say how to rebuild each value, so a new message needs only its class here and a
place in COMMANDS or REPLIES. Both ends run the same serval (the core process imports the front end's), so the field
order is a shared schema. A frame that is not one of these messages raises MessageError, never passes unnoticed.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from serval.engine.core import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest
from serval.engine.request import RequestStatus


class MessageError(ValueError):
    """A frame that is not a message of this module: not msgpack, an unknown class name, fields that do not fit."""


# -- commands: front end → core ------------------------------------------------------------------------------------
@dataclass
class AddRequests:
    """New core requests (one user request's samples, already tokenized and checked)."""

    requests: list[EngineCoreRequest]


@dataclass
class FinishRequests:
    """End these requests in the core and free their blocks: an abort, or a stop string the front end found."""

    request_ids: list[str]
    status: RequestStatus


@dataclass
class EndSession:
    """Let go of a conversation's kept KV."""

    session_id: str


@dataclass
class SetupGrammar:
    """The grammar compiler's tokenizer table (xgrammar's JSON), sent once before the first constrained request."""

    tokenizer_info: str


@dataclass
class KVStateQuery:
    """Asks for the KV cache's state (the /debug/kv view); the KVStateReply carries the same token back."""

    token: str


@dataclass
class Shutdown:
    """Stop stepping and exit."""


# -- replies: core → front end -------------------------------------------------------------------------------------
@dataclass
class CoreConnected:
    """Both sockets are connected (the core's first message, before it loads): their folder can go."""


@dataclass
class CoreReady:
    """The model is loaded: what the front end needs to know of the core."""

    info: EngineCoreInfo


@dataclass
class CoreFailed:
    """The core could not load (the exception's type and message)."""

    reason: str


@dataclass
class KVStateReply:
    token: str
    state: dict


@dataclass
class CoreDead:
    """The core's loop died (the exception and its traceback); the front end fails every open stream."""

    reason: str


# EngineCoreOutputs (engine/core.py), a step's outputs and the core's counters, crosses as it is.
COMMANDS: tuple[type, ...] = (AddRequests, FinishRequests, EndSession, SetupGrammar, KVStateQuery, Shutdown)
REPLIES: tuple[type, ...] = (CoreConnected, CoreReady, CoreFailed, EngineCoreOutputs, KVStateReply, CoreDead)
MESSAGES: tuple[type, ...] = COMMANDS + REPLIES

# -- the codec -----------------------------------------------------------------------------------------------------
# A value's codec is (to_wire, from_wire), built once per type from its annotation; None where msgpack carries the
# value as it is (numbers, strings, lists of them, plain dicts), so a long prompt's token ids are never walked.
_Codec = tuple[Callable[[typing.Any], typing.Any], Callable[[typing.Any], typing.Any]] | None


def _codec(hint) -> _Codec:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass_codec(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return (lambda value: value.value), hint
    if origin in (typing.Union, types.UnionType):
        inner = [_codec(a) for a in args if a is not type(None)]
        if all(c is None for c in inner):
            return None
        if len(inner) != 1:
            raise TypeError(f"a message field of type {hint} cannot cross: one structured type per field")
        to_wire, from_wire = inner[0]
        return ((lambda value: None if value is None else to_wire(value)),
                (lambda raw: None if raw is None else from_wire(raw)))
    if origin is list:
        item = _codec(args[0])
        if item is None:
            return None
        to_item, from_item = item
        return (lambda value: [to_item(v) for v in value]), (lambda raw: [from_item(r) for r in raw])
    if origin is tuple and args[-1:] == (...,):  # any length, one type
        item = _codec(args[0])
        if item is None:
            return list, tuple
        return (lambda value: [item[0](v) for v in value]), (lambda raw: tuple(item[1](r) for r in raw))
    if origin is tuple:  # fixed positions (msgpack brings a tuple back as a list)
        parts = [_codec(a) for a in args]
        return ((lambda value: [v if c is None else c[0](v) for c, v in zip(parts, value)]),
                (lambda raw: tuple(r if c is None else c[1](r) for c, r in zip(parts, _exactly(raw, len(parts))))))
    if origin is dict and any(_codec(a) is not None for a in args):
        raise TypeError(f"a message field of type {hint} cannot cross: dict keys and values must be plain")
    return None


_DATACLASS_CODECS: dict[type, _Codec] = {}


def _dataclass_codec(cls: type) -> _Codec:
    if cls not in _DATACLASS_CODECS:
        fields = dataclasses.fields(cls)
        if not all(f.init for f in fields):
            raise TypeError(f"{cls.__name__} cannot cross: every field must be an __init__ argument")
        hints = typing.get_type_hints(cls)
        codecs = [(i, _codec(hints[f.name])) for i, f in enumerate(fields)]
        convert = [(i, c) for i, c in codecs if c is not None]  # the rest cross as they are
        names = [f.name for f in fields]
        get_fields = operator.attrgetter(*names) if len(names) > 1 else None
        # Once a step and per output: positional, and only the fields that need it converted.

        def to_wire(value) -> list:
            values = list(get_fields(value)) if get_fields else [getattr(value, name) for name in names]
            for i, (to_field, _) in convert:
                values[i] = to_field(values[i])
            return values

        def from_wire(raw):
            values = _exactly(raw, len(names), cls.__name__)  # a fresh list from msgpack: converted in place
            for i, (_, from_field) in convert:
                values[i] = from_field(values[i])
            return cls(*values)

        _DATACLASS_CODECS[cls] = (to_wire, from_wire)
    return _DATACLASS_CODECS[cls]


def _exactly(raw, length: int, what: str = "a tuple") -> list:
    if not isinstance(raw, list) or len(raw) != length:
        raise MessageError(f"{what} needs {length} fields, got {raw!r:.200}")
    return raw


_BY_TAG: dict[str, type] = {cls.__name__: cls for cls in MESSAGES}
for _cls in MESSAGES:  # built at import: a field type the codec cannot carry fails here, not on the first frame
    _dataclass_codec(_cls)


def encode(message) -> bytes:
    """One msgpack frame: the class name, then the fields. Raises ValueError, TypeError or OverflowError for a value
    msgpack cannot carry (an integer past 64 bits, a lone surrogate)."""
    cls = type(message)
    if _BY_TAG.get(cls.__name__) is not cls:
        raise MessageError(f"{cls.__name__} is not a message between front end and core")
    return msgpack.packb([cls.__name__, *_dataclass_codec(cls)[0](message)], use_bin_type=True)


def decode(frame: bytes):
    """The message a frame holds; MessageError for anything else (the frame's start is quoted)."""
    try:
        # Token ids are map keys (logit_bias, top logprobs).
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MessageError(f"not a msgpack frame ({exc}): {frame[:64]!r}") from exc
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise MessageError(f"a message is [class name, fields...], got {raw!r:.200}")
    cls = _BY_TAG.get(raw[0])
    if cls is None:
        raise MessageError(f"unknown message {raw[0]!r:.100}; the known are {', '.join(_BY_TAG)}")
    try:
        return _dataclass_codec(cls)[1](raw[1:])
    except MessageError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong shape, or refused by its class
        raise MessageError(f"a malformed {cls.__name__}: {type(exc).__name__}: {exc}") from exc
