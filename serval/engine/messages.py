"""The messages between the engine's front end (engine/core_client.py) and its core process (engine/core_process.py):
one dataclass per kind, and the values they carry (EngineCoreRequest, EngineCoreOutput(s), EngineCoreStats,
EngineCoreInfo). Neither torch nor the core is imported here: the server's process imports this module.

Commands go from the front end to the core, replies come back. On the wire a message is one msgpack array, its class
name then its fields in the order the class declares them; a nested dataclass (an EngineCoreRequest, its
SamplingParams, an EngineCoreOutput, TokenLogprobs, the core's counters) is an array of its fields in the same way, and
an enum is its value. The field types say how to rebuild each value, so a new message needs only its class here and a
place in COMMANDS or REPLIES. Both ends run the same serval (the core process imports the front end's), so the field
order is a shared schema, and a value is rebuilt without running its __init__ again: it was checked where it was made
(a SamplingParams at the front end's edge), and the other end trusts it. A frame that is not one of these messages
raises MessageError, never passes unnoticed.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from serval.engine.request import RequestStatus
from serval.outputs import TokenLogprobs
from serval.sampling_params import SamplingParams


# -- what crosses: requests in, outputs and counters back ----------------------------------------------------------
@dataclass
class EngineCoreRequest:
    """A request as the core takes it: already tokenized and validated, one per sample (n fans out before)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int  # resolved against the context window
    priority: int = 0
    group_id: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    session_id: str | None = None  # a conversation: its KV is kept for the next turn (kv_cache.py, sessions)
    keep_session: bool = True  # False: the conversation's last turn
    tenant: str = ""  # whose request (a digest of its API key): the scheduler takes tenants' waiting requests in turn


@dataclass
class EngineCoreOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # Prompt logprobs computed this step: (index of the first prompt token scored, one entry per token).
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    first_scheduled_time: float | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None  # a prefill worker's finished request: where its KV is held


@dataclass
class EngineCoreStats:
    """Counters and gauges of the core, sent with every step's outputs (the live view, metrics, load shedding)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model (prompt chunks, recompute, decodes)
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    num_received_requests: int = 0  # adds taken; the front end subtracts it from the adds it sent
    # Conversation sessions: requests that found their session held, the prompt tokens they found cached, and
    # the sessions and blocks held now.
    session_requests: int = 0
    session_hit_tokens: int = 0
    num_sessions: int = 0
    session_blocks: int = 0
    # The KV cache's second tier (zeros without one): preemptions that swapped out, blocks copied each way, prompt
    # tokens found there, and its blocks now (cached, swapped out, all).
    num_swaps: int = 0
    offload_saved_blocks: int = 0
    offload_loaded_blocks: int = 0
    offload_hit_tokens: int = 0
    offload_cached_blocks: int = 0
    offload_swapped_blocks: int = 0
    offload_blocks: int = 0
    # Speculative decoding: steps that checked a request's guesses, guesses checked, guesses accepted, and how
    # often the guess at each position (1st, 2nd, ...) was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    last_batch_size: int = 0
    last_batch_tokens: int = 0
    # Disaggregated prefill/decode (engine/kv_transfer.py): blocks held for decode workers now, blocks and bytes
    # sent and received, holds that expired unfetched, fetches that fell back to computing the prompt here.
    kv_held_blocks: int = 0
    kv_sent_blocks: int = 0
    kv_sent_early_blocks: int = 0  # of those, sent while their prompt's prefill still computed
    kv_sent_bytes: int = 0
    kv_received_blocks: int = 0
    kv_received_bytes: int = 0
    kv_expired_holds: int = 0
    kv_failed_fetches: int = 0
    kv_fetches: int = 0
    kv_fetch_seconds: float = 0.0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: EngineCoreStats


@dataclass
class EngineCoreInfo:
    """What a front end needs to know of the core it talks to (sent once, when the core is ready)."""

    model_path: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    load_time: float
    max_num_batched_tokens: int  # the settled step budget (it is the device's default where none was given)
    kv_transfer_address: str | None = None  # a prefill worker's KV server, where decode workers fetch its blocks


POLL_MS = 200  # how often an idle side checks that the other is still there


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
    """The core could not load (the exception's type and message; a bad model file's one line alone)."""

    reason: str
    model_file: bool = False  # a ModelFileError: the front end raises it as one, printed without a traceback


@dataclass
class KVStateReply:
    token: str
    state: dict


@dataclass
class CoreDead:
    """The core's loop died (the exception and its traceback); the front end fails every open stream."""

    reason: str


# EngineCoreOutputs (above), a step's outputs and the core's counters, crosses as it is.
COMMANDS: tuple[type, ...] = (AddRequests, FinishRequests, EndSession, KVStateQuery, Shutdown)
REPLIES: tuple[type, ...] = (CoreConnected, CoreReady, CoreFailed, EngineCoreOutputs, KVStateReply, CoreDead)
MESSAGES: tuple[type, ...] = COMMANDS + REPLIES
# What the messages carry (EngineCoreOutputs too, a reply itself).
PAYLOADS: tuple[type, ...] = (EngineCoreRequest, EngineCoreOutput, EngineCoreStats, EngineCoreInfo)

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
            return _rebuilt(cls, names, values)

        _DATACLASS_CODECS[cls] = (to_wire, from_wire)
    return _DATACLASS_CODECS[cls]


def _rebuilt(cls: type, names: list[str], values: list):
    """A ``cls`` holding ``values``, its __init__ (and __post_init__'s checks) not run: the sending end made it."""
    value = object.__new__(cls)
    value.__dict__.update(zip(names, values))
    return value


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
