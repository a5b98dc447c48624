"""CoreProcessClient: the front end in this process (tokenize, detokenize, stop strings, outputs), talking over
ZeroMQ to the EngineCore in its own process (engine/core_process.py).

Why a process: the server's HTTP/SSE loop, tokenizing and detokenizing then never share a GIL with the step
loop. The front end binds two ipc:// sockets in a private folder, removed as soon as the core has connected both
(CoreConnected): it PUSHes adds and finishes to the core, and PULLs each step's outputs back. It imports neither the
core nor torch: the messages are engine/messages.py's.

The front end notices a core that exits for any reason (a kill included) within a poll interval and fails every
open stream with EngineDeadError: nothing waits on a dead core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from serval.config import EngineConfig
from serval.engine.client import KV_STATE_TIMEOUT_S, EngineClient, EngineDeadError, RequestStream, settle
from serval.engine.frontend import FrontEnd
from serval.engine.messages import (
    POLL_MS,
    AddRequests,
    CoreConnected,
    CoreDead,
    CoreFailed,
    CoreReady,
    EndSession,
    EngineCoreInfo,
    EngineCoreOutputs,
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
from serval.errors import ModelFileError
from serval.model.registry import resolve_model_path
from serval.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The sockets' folder: /tmp/serval-core-<the front end's pid>-<random>, removed once the core has connected.
IPC_DIR_PREFIX = "serval-core-"
# A folder older than this whose front end is gone was left by a start-up that both processes died in.
ORPHANED_IPC_DIR_AGE_S = 60.0


def remove_orphaned_ipc_dirs() -> None:
    """Removes the sockets' folders of start-ups killed whole: a front end and its core SIGKILLed together before
    the core connected (a process group killed, as Ray does to a replica it stops while it starts) leave a folder
    that neither can remove. The next front end removes those whose front end is gone, once they are a minute old
    (a live start-up's folder lives for seconds)."""
    now = time.time()
    for path in Path(tempfile.gettempdir()).glob(f"{IPC_DIR_PREFIX}*-*"):
        pid = path.name.removeprefix(IPC_DIR_PREFIX).split("-", 1)[0]
        try:
            old = now - path.stat().st_mtime > ORPHANED_IPC_DIR_AGE_S
        except OSError:
            continue
        if pid.isdecimal() and old and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


# The core's process (engine/core_process.py: main): the garbage collector off before anything is imported, until the
# model is loaded (run_engine_core turns it back on).
CORE_COMMAND = (sys.executable, "-c", "import gc; gc.disable(); from serval.engine.core_process import main; main()")


class CoreProcessClient(EngineClient):
    """The front end in this process (tokenize, detokenize, stop strings, outputs), the core in another."""

    def __init__(self, config: EngineConfig, while_loading: Callable[[], None] | None = None) -> None:
        """Starts the core process and returns once it has loaded the model (raises RuntimeError if it fails);
        ``while_loading``, the caller's own start (the HTTP server's imports), runs here meanwhile."""
        super().__init__()
        self.config = config
        self.context_policy = config.context_policy
        model_path = resolve_model_path(config.model)
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe: adds, aborts and stops share it
        self._lock = threading.Lock()  # the output processor: the output thread and the callers' aborts
        self._kv_state_waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.process: subprocess.Popen | None = None
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._results = self._zmq.socket(zmq.PULL)
        remove_orphaned_ipc_dirs()
        self._ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
        try:  # whatever stops the start (a failed load, a SIGTERM while loading): the core killed, the folder removed
            self._commands.bind(f"ipc://{self._ipc_dir}/commands")
            self._results.bind(f"ipc://{self._ipc_dir}/results")
            # A fresh interpreter (no inherited threads or OpenMP pools, and unlike multiprocessing's spawn it never
            # re-runs the caller's __main__); the settings go over its stdin.
            # The child imports this very serval (a checkout run without installing it, a worktree beside another).
            package_root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
            self.process = subprocess.Popen(CORE_COMMAND, stdin=subprocess.PIPE, env=env)
            self.process.stdin.write(pickle.dumps((config, model_path, f"ipc://{self._ipc_dir}/commands",
                                                   f"ipc://{self._ipc_dir}/results", os.getpid())))
            self.process.stdin.close()
            # The front end (its checks, the tokenizer: seconds for a GGUF's first conversion) while the core loads.
            self.front = FrontEnd(config)
            self.tokenizer, self.sampling_defaults = self.front.tokenizer, self.front.sampling_defaults
            if while_loading is not None:
                while_loading()
            info = self._wait_ready()
        except BaseException:
            self._close(kill=True)
            raise
        self.info = info
        self.max_model_len, self.vocab_size, self.load_time = info.max_model_len, info.vocab_size, info.load_time
        self.kv_transfer_address = info.kv_transfer_address
        self.front.connect(info)
        self._stats = EngineCoreStats(num_blocks=info.num_blocks, num_free_blocks=info.num_blocks)
        self._num_sent = 0  # core requests sent; the core's num_received_requests says how many it took
        self._num_preparing = 0  # sequences of adds being tokenized and checked (on the event loop's thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_outputs, name="serval-core-outputs", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, while_loading: Callable[[], None] | None = None) -> CoreProcessClient:
        return cls(config, while_loading)

    def _wait_ready(self) -> EngineCoreInfo:
        while True:
            # Checked before the poll: a core that said why it failed and exited is heard before its exit is.
            exited = self.process.poll() is not None
            if self._results.poll(0 if exited else POLL_MS):
                match decode(self._results.recv()):
                    case CoreConnected():
                        self._remove_ipc_dir()
                    case CoreReady(info):
                        return info
                    case CoreFailed(reason, model_file):
                        if model_file:  # the model's files: one line, as the front end's own check gives
                            raise ModelFileError(reason)
                        raise RuntimeError(f"the engine core failed to load: {reason}")
                    case other:
                        raise MessageError(f"the engine core sent {type(other).__name__} before it was ready")
            elif exited:
                raise RuntimeError(f"the engine core process exited with code {self.process.returncode} while "
                                   "loading")

    def _remove_ipc_dir(self) -> None:
        """Removes the sockets' folder once the core's commands socket is connected too (its results socket is: it
        sent CoreConnected). Open connections need no path, so from here on nothing can leave the folder behind,
        however the two processes end (a SIGKILL to both included)."""
        while not self._commands.poll(POLL_MS, zmq.POLLOUT):  # writable: the core's end is attached
            if self.process.poll() is not None:
                return  # the caller hears of the exit and closes
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.process.poll() is None:
            self._send(Shutdown())
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
                          end_session: bool = False, tenant: str = "") -> RequestStream:
        if not self.is_alive:
            raise EngineDeadError(f"the engine core is not running: {self.error}" if self.error else
                                  "the engine core is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Tokenizing a long prompt and checking a grammar take a while: off the event loop. Counted as waiting
        # meanwhile, or a burst would all pass the server's load check before any of them was sent.
        self._num_preparing += params.n  # its sequences, as the core will count them
        try:
            prepared = await asyncio.to_thread(self.front.prepare, self, request_id, prompt, params, priority,
                                               session_id, end_session, tenant)  # ValueError
        finally:
            self._num_preparing -= params.n
        stream = RequestStream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if self.error is not None:  # the core died since the check above, and its streams were failed already
                raise EngineDeadError(f"the engine core is not running: {self.error}")
            self.front.register(prepared)
            self._streams[request_id] = stream
            self._num_sent += len(prepared.core_requests)
        self.send(prepared.packed)
        return stream

    # The front end's core client (frontend.CoreClient): the core process, over ZeroMQ.
    def pack(self, core_requests: list) -> bytes:
        """The AddRequests frame, made before anything is registered: a request that cannot cross to the core
        leaves no trace."""
        try:
            return encode(AddRequests(core_requests))
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an integer past 64 bits, a lone surrogate
            raise ValueError(f"the request cannot be sent to the engine: {exc}") from exc

    def send(self, frame: bytes) -> None:
        with self._send_lock:
            if not self._commands.closed:
                self._commands.send(frame)

    def abort(self, request_id: str) -> None:
        with self._lock:
            output, running = self.front.outputs.abort(request_id)
        if output is None:
            return
        if running:
            self._send(FinishRequests(running, RequestStatus.FINISHED_ABORTED))
        self._deliver(request_id, output, True)

    def end_session(self, session_id: str) -> None:
        self._send(EndSession(session_id))

    async def kv_state(self) -> dict:
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        token = os.urandom(8).hex()
        with self._lock:
            self._kv_state_waiters[token] = (loop, answer)
        try:
            self._send(KVStateQuery(token))
            return await asyncio.wait_for(answer, KV_STATE_TIMEOUT_S)
        finally:
            with self._lock:
                self._kv_state_waiters.pop(token, None)

    def snapshot(self) -> EngineCoreStats:
        stats = self._stats
        pending = max(0, self._num_sent - stats.num_received_requests)  # sent, not yet taken: waiting too
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + pending + self._num_preparing)

    def _send(self, message) -> None:
        self.send(encode(message))

    # -- the output thread ---------------------------------------------------------------------------------------
    def _read_outputs(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._results.poll(POLL_MS):
                    if self.process.poll() is not None:
                        raise EngineDeadError(f"the engine core process exited with code {self.process.returncode}")
                    continue
                match decode(self._results.recv()):  # MessageError: every open stream hears it (below)
                    case EngineCoreOutputs() as core_outputs:
                        self._take_outputs(core_outputs)
                    case KVStateReply(token, state):
                        with self._lock:
                            waiter = self._kv_state_waiters.pop(token, None)
                        if waiter is not None:
                            waiter[0].call_soon_threadsafe(settle, waiter[1], state)
                    case CoreDead(reason):
                        raise EngineDeadError(f"engine core loop died: {reason}")
                    case other:
                        raise MessageError(f"the front end takes no {type(other).__name__} from a running core")
        except BaseException as exc:  # noqa: BLE001 - every open stream hears it; nothing hangs
            if not self._stop.is_set():
                logger.error("engine core is gone: %s", exc)
                with self._lock:  # a request added from now on is refused; those added before are failed here
                    self.error = exc
                self._fail_all(exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc)))
        finally:
            self._results.close(linger=0)

    def _take_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        with self._lock:
            outputs, ended_here = self.front.outputs.process(core_outputs.outputs)
            self._stats = core_outputs.stats
        if ended_here:  # stop strings (and output failures) end the core's requests too
            self._send(FinishRequests(ended_here, RequestStatus.FINISHED_STOPPED))
        for output in outputs:
            self._deliver(output.request_id, output, output.finished)


