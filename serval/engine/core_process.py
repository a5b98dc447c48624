"""The EngineCore in its own process, and CoreProcessClient: the front end that talks to it over ZeroMQ.

Why a process: the server's HTTP/SSE loop, tokenizing and detokenizing then never share a GIL with the step
loop. The front end (this process) binds two ipc:// sockets: it PUSHes adds and finishes to the core, and PULLs
each step's outputs (token ids, logprobs, finish reasons, the core's counters) back. Frames are msgpack.

The core process exits when told to, when its loop dies (after saying why), or when its parent is gone. The
front end notices a core that exits for any reason (a kill included) within a poll interval and fails every
open stream with EngineDeadError: nothing waits on a dead core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import msgpack
import zmq

from serval.config import EngineConfig
from serval.engine.client import KV_STATE_TIMEOUT_S, EngineClient, EngineDeadError, RequestStream, settle
from serval.engine.core import (
    EngineCore,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
)
from serval.engine.frontend import InputProcessor, OutputProcessor
from serval.engine.request import RequestStatus
from serval.layers.sampler import TokenLogprobs
from serval.lifetime import end_with_parent
from serval.model.registry import resolve_model_path
from serval.model.sampling_defaults import resolve_sampling_defaults
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

POLL_MS = 200  # how often an idle side checks that the other is still there


# -- frames --------------------------------------------------------------------------------------------------------
def _logprobs_to_wire(entry: TokenLogprobs | None):
    return None if entry is None else (entry.token_id, entry.logprob, entry.rank, entry.top)


def _logprobs_from_wire(raw) -> TokenLogprobs | None:
    return None if raw is None else TokenLogprobs(raw[0], raw[1], raw[2], raw[3])


def encode_request(r: EngineCoreRequest) -> list:
    return [r.request_id, r.prompt_token_ids, dataclasses.asdict(r.params), r.eos_token_ids, r.max_tokens, r.priority,
            r.group_id, r.arrival_time, r.session_id, r.keep_session]


def decode_request(raw: list) -> EngineCoreRequest:
    request_id, prompt, params, eos, max_tokens, priority, group_id, arrival, session_id, keep_session = raw
    return EngineCoreRequest(request_id, prompt, SamplingParams(**params), eos, max_tokens, priority, group_id,
                             arrival, session_id, keep_session)


def encode_outputs(outputs: EngineCoreOutputs) -> list:
    rows = []
    for o in outputs.outputs:
        logprobs = None if o.new_logprobs is None else [_logprobs_to_wire(e) for e in o.new_logprobs]
        prompt_logprobs = None
        if o.prompt_logprobs is not None:
            prompt_logprobs = (o.prompt_logprobs[0], [_logprobs_to_wire(e) for e in o.prompt_logprobs[1]])
        rows.append([o.request_id, o.new_token_ids, logprobs, o.finish_reason, o.stop_reason, o.num_cached_tokens,
                     prompt_logprobs, o.first_scheduled_time, o.error, o.kv_transfer_params])
    return ["outputs", rows, dataclasses.astuple(outputs.stats)]


def decode_outputs(raw: list) -> EngineCoreOutputs:
    _, rows, stats = raw
    outputs = []
    for request_id, tokens, logprobs, finish, stop, cached, prompt_logprobs, scheduled_at, error, kv in rows:
        if logprobs is not None:
            logprobs = [_logprobs_from_wire(e) for e in logprobs]
        if prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs[0], [_logprobs_from_wire(e) for e in prompt_logprobs[1]])
        outputs.append(EngineCoreOutput(request_id, tokens, logprobs, finish, stop, cached, prompt_logprobs,
                                        scheduled_at, error, kv))
    return EngineCoreOutputs(outputs, EngineCoreStats(*stats))


def pack(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes):
    # Token ids are map keys (logit_bias, top logprobs); tuples come back as lists.
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# -- the core's process --------------------------------------------------------------------------------------------
def run_engine_core(config: EngineConfig, model_path: str, input_address: str, output_address: str,
                    parent_pid: int) -> None:
    """The core process's main: load, say ready (or why not), then take commands and step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it stops us in order
    # The server gone (a SIGKILL too) at any phase, loading included: the kernel sends SIGHUP, and the core removes
    # the sockets' folder, which nobody else is left to remove, and exits. SIGKILL could not clean up.
    ipc_dir = os.path.dirname(input_address.removeprefix("ipc://"))
    signal.signal(signal.SIGHUP, lambda signum, frame: _exit_orphaned(ipc_dir))
    end_with_parent(parent_pid, signal.SIGHUP)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(input_address)
    results = context.socket(zmq.PUSH)
    results.connect(output_address)
    try:
        core = EngineCore(config, model_path)
    except BaseException as exc:  # noqa: BLE001 - the front end raises it
        results.send(pack(["failed", f"{type(exc).__name__}: {exc}"]))
        results.close(linger=5000)
        return
    results.send(pack(["ready", dataclasses.astuple(core.info)]))
    try:
        _core_loop(core, commands, results, parent_pid)
        core.shutdown()
    except BaseException as exc:  # noqa: BLE001 - the loop died: the front end must hear why
        logger.exception("engine core loop died")
        results.send(pack(["dead", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"]))
    finally:
        results.close(linger=2000)
        commands.close(linger=0)
        context.term()


def _exit_orphaned(ipc_dir: str) -> None:
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


def _core_loop(core: EngineCore, commands: zmq.Socket, results: zmq.Socket, parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:  # the server is gone (killed): nobody will read our outputs; checked every
            return                      # step too, where no parent-death signal exists (not Linux)
        # Holds fetched or expired give their blocks back, even while idle: the front end hears the new counts.
        freed = core.poll_kv_transfers()
        busy = core.has_unfinished_requests()
        if freed and not busy:
            results.send(pack(encode_outputs(EngineCoreOutputs([], core.snapshot()))))
        if commands.poll(0 if busy else POLL_MS):
            while True:
                try:
                    message = unpack(commands.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                kind = message[0]
                if kind == "add":
                    for raw in message[1]:
                        core.add_request(decode_request(raw))
                elif kind == "grammar_setup":
                    from serval.engine.structured_output import GrammarCompiler
                    core.setup_structured_outputs(GrammarCompiler.from_json(message[1]))
                elif kind == "finish":
                    core.finish_requests(message[1], RequestStatus(message[2]))
                elif kind == "end_session":
                    core.end_session(message[1])
                elif kind == "kv_state":  # answered at once, between two steps
                    results.send(pack(["kv_state", message[1], core.kv_state()]))
                elif kind == "shutdown":
                    return
        elif not busy:
            continue
        if core.has_unfinished_requests():
            results.send(pack(encode_outputs(core.step())))
        else:  # the commands emptied the core (aborts, stops): no step follows to carry the freed blocks' counters
            results.send(pack(encode_outputs(EngineCoreOutputs([], core.snapshot()))))


# -- the front end's side ------------------------------------------------------------------------------------------
class CoreProcessClient(EngineClient):
    """The front end in this process (tokenize, detokenize, stop strings, outputs), the core in another."""

    def __init__(self, config: EngineConfig) -> None:
        """Starts the core process and returns once it has loaded the model (raises RuntimeError if it fails)."""
        super().__init__()
        self.config = config
        self.context_policy = config.context_policy
        model_path = resolve_model_path(config.model)
        self.sampling_defaults = resolve_sampling_defaults(config.model, model_path, config.generation_config,
                                                           config.override_generation_config)
        self.tokenizer = Tokenizer.load(model_path)
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe: adds, aborts and stops share it
        self._lock = threading.Lock()  # the output processor: the output thread and the callers' aborts
        self._kv_state_waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.process: subprocess.Popen | None = None
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._results = self._zmq.socket(zmq.PULL)
        self._ipc_dir = tempfile.mkdtemp(prefix="serval-core-")
        try:  # whatever stops the start (a failed load, a SIGTERM while loading): the core killed, the folder removed
            self._commands.bind(f"ipc://{self._ipc_dir}/commands")
            self._results.bind(f"ipc://{self._ipc_dir}/results")
            # A fresh interpreter (no inherited threads or OpenMP pools, and unlike multiprocessing's spawn it never
            # re-runs the caller's __main__); the settings go over its stdin.
            # The child imports this very serval (a checkout run without installing it, a worktree beside another).
            package_root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
            self.process = subprocess.Popen([sys.executable, "-m", "serval.engine.core_process"],
                                            stdin=subprocess.PIPE, env=env)
            self.process.stdin.write(pickle.dumps((config, model_path, f"ipc://{self._ipc_dir}/commands",
                                                   f"ipc://{self._ipc_dir}/results", os.getpid())))
            self.process.stdin.close()
            info = self._wait_ready()
        except BaseException:
            self._close(kill=True)
            raise
        self.info = info
        self.max_model_len, self.vocab_size, self.load_time = info.max_model_len, info.vocab_size, info.load_time
        self.kv_transfer_address = info.kv_transfer_address
        self._inputs = InputProcessor(config, self.tokenizer, info)
        self._outputs = OutputProcessor(self.tokenizer)
        self._stats = EngineCoreStats(num_blocks=info.num_blocks, num_free_blocks=info.num_blocks)
        self._num_sent = 0  # core requests sent; the core's num_received_requests says how many it took
        self._grammar_sent = False  # the grammar compiler's tokenizer table, sent before the first grammar
        self._grammar_setup_lock = threading.Lock()
        self._num_preparing = 0  # adds being tokenized and checked (on the event loop's thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_outputs, name="serval-core-outputs", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig) -> CoreProcessClient:
        return cls(config)

    def _wait_ready(self) -> EngineCoreInfo:
        while True:
            if self._results.poll(POLL_MS):
                message = unpack(self._results.recv())
                if message[0] == "ready":
                    return EngineCoreInfo(*message[1])
                raise RuntimeError(f"the engine core failed to load: {message[1]}")
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine core process exited with code {self.process.returncode} while "
                                   "loading")

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.process.poll() is None:
            self._send(["shutdown"])
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._close(kill=True)

    def _close(self, kill: bool) -> None:
        if kill and self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        with self._send_lock:
            self._commands.close(linger=0)
        if not (hasattr(self, "_thread") and self._thread.is_alive()):
            self._results.close(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.process.poll() is None and self._thread.is_alive()

    # -- requests ------------------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, session_id: str | None = None,
                          end_session: bool = False) -> RequestStream:
        if not self.is_alive:
            raise EngineDeadError(f"the engine core is not running: {self.error}" if self.error else
                                  "the engine core is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Tokenizing a long prompt and checking a grammar take a while: off the event loop. Counted as waiting
        # meanwhile, or a burst would all pass the server's load check before any of them was sent.
        self._num_preparing += 1
        try:
            prompt_text, core_requests, frame = await asyncio.to_thread(
                self._prepare, request_id, prompt, params, priority, session_id, end_session)  # ValueError
        finally:
            self._num_preparing -= 1
        stream = RequestStream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if self.error is not None:  # the core died since the check above, and its streams were failed already
                raise EngineDeadError(f"the engine core is not running: {self.error}")
            self._outputs.add(request_id, prompt_text, core_requests)
            self._streams[request_id] = stream
            self._num_sent += len(core_requests)
        self._send_frame(frame)
        return stream

    def _prepare(self, request_id, prompt, params, priority, session_id, end_session):
        prompt_text, core_requests = self._inputs.process(request_id, prompt, params, priority, session_id,
                                                          end_session)
        if core_requests[0].params.structured_outputs is not None:
            with self._grammar_setup_lock:  # once, before the first grammar (the byte table takes a second)
                if not self._grammar_sent:
                    self._send(["grammar_setup", self._inputs.grammar_compiler().to_json()])
                    self._grammar_sent = True
        try:  # before anything is registered: a request that cannot cross to the core leaves no trace
            frame = pack(["add", [encode_request(r) for r in core_requests]])
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an integer past 64 bits, a lone surrogate
            raise ValueError(f"the request cannot be sent to the engine: {exc}") from exc
        return prompt_text, core_requests, frame

    def abort(self, request_id: str) -> None:
        with self._lock:
            output, running = self._outputs.abort(request_id)
        if output is None:
            return
        if running:
            self._send(["finish", running, RequestStatus.FINISHED_ABORTED.value])
        self._deliver(request_id, output, True)

    def end_session(self, session_id: str) -> None:
        self._send(["end_session", session_id])

    async def kv_state(self) -> dict:
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        token = os.urandom(8).hex()
        with self._lock:
            self._kv_state_waiters[token] = (loop, answer)
        try:
            self._send(["kv_state", token])
            return await asyncio.wait_for(answer, KV_STATE_TIMEOUT_S)
        finally:
            with self._lock:
                self._kv_state_waiters.pop(token, None)

    def snapshot(self) -> EngineCoreStats:
        stats = self._stats
        pending = max(0, self._num_sent - stats.num_received_requests)  # sent, not yet taken: waiting too
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + pending + self._num_preparing)

    def _send(self, message) -> None:
        self._send_frame(pack(message))

    def _send_frame(self, frame: bytes) -> None:
        with self._send_lock:
            if not self._commands.closed:
                self._commands.send(frame)

    # -- the output thread ---------------------------------------------------------------------------------------
    def _read_outputs(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._results.poll(POLL_MS):
                    if self.process.poll() is not None:
                        raise EngineDeadError(f"the engine core process exited with code {self.process.returncode}")
                    continue
                message = unpack(self._results.recv())
                if message[0] == "dead":
                    raise EngineDeadError(f"engine core loop died: {message[1]}")
                if message[0] == "kv_state":
                    with self._lock:
                        waiter = self._kv_state_waiters.pop(message[1], None)
                    if waiter is not None:
                        waiter[0].call_soon_threadsafe(settle, waiter[1], message[2])
                    continue
                core_outputs = decode_outputs(message)
                with self._lock:
                    outputs, ended_here = self._outputs.process(core_outputs.outputs)
                    self._stats = core_outputs.stats
                if ended_here:  # stop strings (and output failures) end the core's requests too
                    self._send(["finish", ended_here, RequestStatus.FINISHED_STOPPED.value])
                for output in outputs:
                    self._deliver(output.request_id, output, output.finished)
        except BaseException as exc:  # noqa: BLE001 - every open stream hears it; nothing hangs
            if not self._stop.is_set():
                logger.error("engine core is gone: %s", exc)
                with self._lock:  # a request added from now on is refused; those added before are failed here
                    self.error = exc
                self._fail_all(exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc)))
        finally:
            self._results.close(linger=0)


if __name__ == "__main__":  # the core process: `python -m serval.engine.core_process`, settings on stdin
    run_engine_core(*pickle.loads(sys.stdin.buffer.read()))
