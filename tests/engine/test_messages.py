"""The messages between front end and core (engine/messages.py): each kind crosses msgpack and comes back equal, with
its nested types rebuilt; a frame that is no message is a MessageError; the core's loop and the front end's output
thread take each message by its class and refuse the rest. No model: a fake core and in-process sockets."""

from __future__ import annotations

import threading
import uuid

import msgpack
import pytest
import zmq

from serval import SamplingParams
from serval.engine import core_client, core_process, messages
from serval.engine.client import EngineClient
from serval.engine.messages import (
    AddRequests,
    CoreConnected,
    CoreDead,
    CoreFailed,
    CoreReady,
    EndSession,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
    FinishRequests,
    KVStateQuery,
    KVStateReply,
    MessageError,
    Shutdown,
    decode,
    encode,
)
from serval.engine.request import RequestStatus
from serval.outputs import TokenLogprobs
from serval.sampling_params import StructuredOutputsParams

GRAMMAR_PARAMS = SamplingParams(temperature=0, max_tokens=12, logit_bias={49151: 2.5}, stop=["}"],
                                structured_outputs=StructuredOutputsParams(json={"type": "object"}),
                                kv_transfer_params={"do_remote_decode": True})
REQUEST = EngineCoreRequest("chat-1#0", [1, 2, 3], GRAMMAR_PARAMS, [2], 12, priority=3, group_id="chat-1",
                            arrival_time=5.25, session_id="s1", keep_session=False, tenant="9f86d081")
ENTRY = TokenLogprobs(42, -0.25, 1, {42: -0.25, 7: -1.5})
OUTPUTS = EngineCoreOutputs(
    [EngineCoreOutput("a", [42, 7], [ENTRY, ENTRY], "stop", "}", 16, (1, [ENTRY]), 3.0, None,
                      {"remote_block_ids": [4, 5], "remote_address": "tcp://10.0.0.1:5600"})],
    EngineCoreStats(num_running=1, kv_cache_usage=0.5, spec_accepted_per_position=[3, 1], kv_fetch_seconds=0.25))
# One example of every message, each field unlike its default.
EXAMPLES = {
    AddRequests: AddRequests([REQUEST, EngineCoreRequest("r", [9], SamplingParams(), [0], 16)]),
    FinishRequests: FinishRequests(["a#0", "a#1"], RequestStatus.FINISHED_ABORTED),
    EndSession: EndSession("s1"),
    KVStateQuery: KVStateQuery("0a1b"),
    Shutdown: Shutdown(),
    CoreConnected: CoreConnected(),
    CoreReady: CoreReady(EngineCoreInfo("/m.gguf", 2048, 49152, 300, 1.5, 128, "tcp://127.0.0.1:5600")),
    CoreFailed: CoreFailed("ValueError: fewer than 2 blocks"),
    EngineCoreOutputs: OUTPUTS,
    KVStateReply: KVStateReply("0a1b", {"blocks": {"free": 3}, "sessions": [{"id": "s1", "blocks": [1, 2]}]}),
    CoreDead: CoreDead("RuntimeError: boom\nTraceback ..."),
}


def test_every_message_has_an_example_and_the_directions_do_not_overlap():
    assert set(EXAMPLES) == set(messages.MESSAGES)
    assert not set(messages.COMMANDS) & set(messages.REPLIES)


@pytest.mark.parametrize("cls", messages.MESSAGES, ids=lambda cls: cls.__name__)
def test_every_message_round_trips(cls):
    message = EXAMPLES[cls]
    again = decode(encode(message))
    assert type(again) is cls and again == message  # dataclass equality: nested classes, tuples and enums too


def test_nested_values_come_back_as_their_types():
    request = decode(encode(EXAMPLES[AddRequests])).requests[0]
    assert isinstance(request.params, SamplingParams)
    assert request.params.structured_outputs == StructuredOutputsParams(json={"type": "object"})
    assert request.params.logit_bias == {49151: 2.5}  # an int key, not "49151"
    finish = decode(encode(EXAMPLES[FinishRequests]))
    assert finish.status is RequestStatus.FINISHED_ABORTED
    output = decode(encode(OUTPUTS)).outputs[0]
    assert output.prompt_logprobs == (1, [ENTRY]) and isinstance(output.prompt_logprobs, tuple)
    assert output.new_logprobs[0].top == {42: -0.25, 7: -1.5}


def test_the_core_takes_sampling_params_as_the_front_end_checked_them(monkeypatch):
    """SamplingParams are checked once, where they are made: decoding a request does not run their checks again."""
    frame = encode(EXAMPLES[AddRequests])

    def checked_again(self):
        raise AssertionError("SamplingParams.__post_init__ ran again in the core")

    monkeypatch.setattr(SamplingParams, "__post_init__", checked_again)
    monkeypatch.setattr(StructuredOutputsParams, "__post_init__", checked_again)
    assert decode(frame) == EXAMPLES[AddRequests]

def test_an_unknown_message_is_a_named_error():
    with pytest.raises(MessageError, match="unknown message 'Bogus'"):
        decode(msgpack.packb(["Bogus", 1]))


@pytest.mark.parametrize("frame, match", [
    (b"\xc1", "not a msgpack frame"),
    (msgpack.packb({"kind": "add"}), r"\[class name, fields...\]"),
    (msgpack.packb([]), r"\[class name, fields...\]"),
    (msgpack.packb(["EndSession"]), "EndSession needs 1 fields"),
    (msgpack.packb(["EndSession", "s", "extra"]), "EndSession needs 1 fields"),
    (msgpack.packb(["FinishRequests", ["a"], "no such status"]), "a malformed FinishRequests: ValueError"),
    (msgpack.packb(["CoreReady", [1, 2]]), "EngineCoreInfo needs 7 fields"),
    (msgpack.packb(["AddRequests", "not a list"]), "EngineCoreRequest needs 11 fields"),
])
def test_a_malformed_frame_is_a_named_error(frame, match):
    with pytest.raises(MessageError, match=match):
        decode(frame)


def test_only_messages_are_encoded():
    with pytest.raises(MessageError, match="EngineCoreRequest is not a message"):
        encode(REQUEST)


class FakeCore:
    """The calls the core loop makes, recorded; never busy, so the loop only takes commands."""

    def __init__(self) -> None:
        self.calls = []

    def poll_kv_transfers(self) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return False

    def snapshot(self) -> EngineCoreStats:
        return EngineCoreStats(num_blocks=8, num_free_blocks=8)

    def kv_state(self) -> dict:
        return {"blocks": 8}

    def add_request(self, request) -> None:
        self.calls.append(("add_request", request))

    def finish_requests(self, request_ids, status) -> None:
        self.calls.append(("finish_requests", request_ids, status))

    def end_session(self, session_id) -> None:
        self.calls.append(("end_session", session_id))


@pytest.fixture
def sockets():
    """(the front end's PUSH, the core's PULL, the core's PUSH, the front end's PULL) over inproc://."""
    context = zmq.Context()
    name = uuid.uuid4().hex
    pairs = []
    for direction in ("commands", "results"):
        push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        pull.bind(f"inproc://{name}-{direction}")
        push.connect(f"inproc://{name}-{direction}")
        pairs.append((push, pull))
    (send_command, commands), (results, read_result) = pairs
    yield send_command, commands, results, read_result
    for socket in (send_command, commands, results, read_result):
        socket.close(linger=0)
    context.term()


def _run_core_loop(core, commands, results) -> BaseException | None:
    """Runs the core loop to its end on a thread (a hung loop fails the test); what it raised, if anything."""
    raised = []

    def run():
        try:
            core_process._core_loop(core, commands, results, core_process.os.getppid())
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the core loop did not end"
    return raised[0] if raised else None


def _replies(read_result) -> list:
    found = []
    while read_result.poll(0):
        found.append(decode(read_result.recv()))
    return found


def test_the_core_loop_hands_each_command_to_its_handler(sockets):
    send_command, commands, results, read_result = sockets
    core = FakeCore()
    for message in (EXAMPLES[AddRequests], EXAMPLES[FinishRequests], EndSession("s1"),
                    KVStateQuery("t1"), Shutdown(), EndSession("after the shutdown")):
        send_command.send(encode(message))
    assert _run_core_loop(core, commands, results) is None
    added = EXAMPLES[AddRequests].requests
    assert core.calls == [("add_request", added[0]), ("add_request", added[1]),
                          ("finish_requests", ["a#0", "a#1"], RequestStatus.FINISHED_ABORTED),
                          ("end_session", "s1")]
    assert KVStateReply("t1", {"blocks": 8}) in _replies(read_result)


@pytest.mark.parametrize("frame, match", [
    (msgpack.packb(["Bogus"]), "unknown message 'Bogus'"),
    (encode(CoreDead("x")), "the engine core takes no CoreDead"),
])
def test_the_core_loop_dies_naming_a_message_it_cannot_take(sockets, frame, match):
    send_command, commands, results, _ = sockets
    core = FakeCore()
    send_command.send(encode(EndSession("before")))
    send_command.send(frame)
    send_command.send(encode(EndSession("after")))
    raised = _run_core_loop(core, commands, results)
    assert isinstance(raised, MessageError) and match in str(raised)
    assert core.calls == [("end_session", "before")]  # nothing after the bad frame is taken


class _Running:
    returncode = None

    def poll(self):
        return None


@pytest.mark.parametrize("frame, match", [
    (msgpack.packb(["Bogus", 1]), "unknown message 'Bogus'"),
    (encode(CoreReady(EXAMPLES[CoreReady].info)), "the front end takes no CoreReady from a running core"),
    (encode(Shutdown()), "the front end takes no Shutdown"),
])
def test_the_output_thread_fails_every_stream_naming_a_message_it_cannot_take(sockets, frame, match):
    """The output thread's loop, on a client without a process: a bad reply ends it with the error, the engine dead."""
    _, _, results, read_result = sockets
    client = core_client.CoreProcessClient.__new__(core_client.CoreProcessClient)
    EngineClient.__init__(client)
    client._stop, client._lock, client._results, client.process = threading.Event(), threading.Lock(), read_result, \
        _Running()
    results.send(encode(KVStateReply("nobody waits", {})))  # taken and dropped: no waiter holds that token
    results.send(frame)
    client._kv_state_waiters = {}
    client._read_outputs()  # returns: the thread's loop ended
    assert isinstance(client.error, MessageError) and match in str(client.error)
    assert client.dead.is_set()


@pytest.mark.parametrize("hint", [dict[str, TokenLogprobs], TokenLogprobs | EngineCoreStats])
def test_a_field_type_the_codec_cannot_rebuild_is_refused_when_its_codec_is_built(hint):
    with pytest.raises(TypeError, match="cannot cross"):
        messages._codec(hint)
