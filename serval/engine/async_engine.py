"""AsyncEngine: the EngineClient that steps an LLMEngine (front end and core) on one thread of this process.

Only the engine thread touches the LLMEngine. Callers talk to it through a queue of commands (plain dataclasses:
add, abort, end a session, read the KV state) and get outputs through one asyncio queue per request. The model's
matmuls release the GIL, so the event loop (HTTP, JSON, SSE) keeps running while a step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from serval.config import EngineConfig
from serval.engine.client import KV_STATE_TIMEOUT_S, EngineClient, EngineDeadError, RequestStream, settle
from serval.engine.engine import LLMEngine
from serval.engine.messages import EngineCoreStats
from serval.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# -- the commands the engine thread takes ----------------------------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    session_id: str | None
    end_session: bool
    tenant: str
    stream: RequestStream
    accepted: asyncio.Future  # settled once the engine took the request, or with its ValueError


@dataclass
class _Abort:
    request_id: str


@dataclass
class _EndSession:
    session_id: str


@dataclass
class _KVState:
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future


_Command = _Add | _Abort | _EndSession | _KVState


class AsyncEngine(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults
        self.vocab_size = engine.core.info.vocab_size
        self.kv_transfer_address = engine.core.info.kv_transfer_address
        self.context_policy = engine.config.context_policy
        self.load_time = engine.load_time
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Adds sent to the engine thread that it has not taken yet: they are waiting too, or a burst arriving
        # within one step would all see an empty queue and slip past load shedding.
        self._num_pending_adds = 0  # sequences of adds not yet taken by the engine
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by start() for a thread that loaded the engine and waits
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._prepares_grammars = False  # a server's engine prepares the grammar compiler once idle (idle_for)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Loads the engine on the thread that will step it (and returns once it is loaded). OpenMP keeps a
        worker pool per thread that starts parallel work: a model loaded on one thread and stepped on another
        leaves two pools beside each other, and on 2 cores every parallel region of the steps then took about
        1.6x as long (measured: 21-28 ms a decode step instead of 13-15)."""
        loaded: queue.SimpleQueue = queue.SimpleQueue()
        go = threading.Event()
        owner: list[AsyncEngine] = []

        def engine_thread() -> None:
            try:
                loaded.put(LLMEngine(config))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                loaded.put(exc)
                return
            go.wait()
            owner[0]._run()

        thread = threading.Thread(target=engine_thread, name="serval-engine", daemon=True)
        thread.start()
        result = loaded.get()
        if isinstance(result, BaseException):
            thread.join()  # it has nothing left to do: gone before the caller hears why
            raise result
        owner.append(cls(result))
        owner[0]._thread, owner[0]._go = thread, go
        owner[0]._prepares_grammars = True  # a server's engine, as the core process: core_process._core_loop
        return owner[0]

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._go is not None:  # the thread that loaded the engine steps it
            self._go.set()
            return
        self._thread = threading.Thread(target=self._run, name="serval-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._go is not None:
            self._go.set()  # a thread never started still waits: let it see the stop and end
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    # -- requests ------------------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, session_id: str | None = None,
                          end_session: bool = False, tenant: str = "") -> RequestStream:
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = RequestStream(asyncio.Queue(), loop)
        with self._pending_lock:
            self._num_pending_adds += params.n  # queued sequences, as the engine will count them
        self._commands.put(_Add(request_id, prompt, params, priority, session_id, end_session, tenant, stream,
                                accepted))
        self._wake.set()
        if self.error is not None:  # the loop died since the check above: nobody else will answer this add
            self._refuse_pending_adds()
        try:
            await accepted  # raises the engine's ValueError for bad input
        except asyncio.CancelledError:  # the caller left before the engine took the request
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    def end_session(self, session_id: str) -> None:
        self._commands.put(_EndSession(session_id))
        self._wake.set()

    async def kv_state(self) -> dict:
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        self._commands.put(_KVState(loop, answer))
        self._wake.set()
        return await asyncio.wait_for(answer, KV_STATE_TIMEOUT_S)

    def snapshot(self) -> EngineCoreStats:
        stats = self.engine.core.snapshot()
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + self._num_pending_adds)

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.core.poll_kv_transfers()  # a prefill worker's expired holds, while idle
                    if not self._wake.wait(timeout=0.5) and self._prepares_grammars:
                        self.engine.core.grammars.idle_for(time.monotonic() - self.last_step_time)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.last_step_time = time.monotonic()
                for output in outputs:
                    self._deliver(output.request_id, output, output.finished)
        except BaseException as exc:  # the loop is dead: every waiting caller must hear it
            logger.exception("engine loop died")
            self.error = exc
            self._refuse_pending_adds()
            self._fail_all(EngineDeadError(f"engine loop died: {exc}"))
        else:
            self.engine.shutdown()

    def _refuse_pending_adds(self) -> None:
        """Once the loop has died: each add still queued hears EngineDeadError (callable from any thread)."""
        for command in self._queued_commands():
            if isinstance(command, _Add):
                with self._pending_lock:
                    self._num_pending_adds -= command.params.n
                error = EngineDeadError("the engine loop is not running")
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
                    command.stream.loop.call_soon_threadsafe(settle, command.accepted, None, error)

    def _queued_commands(self) -> Iterator[_Command]:
        """The commands queued so far, each taken off the queue as it is yielded."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for command in self._queued_commands():
            match command:
                case _Add():
                    self._take(command)
                case _Abort(request_id):
                    if request_id in self._streams:
                        self.engine.abort_request(request_id)
                case _EndSession(session_id):
                    self.engine.end_session(session_id)
                case _KVState(loop, answer):
                    loop.call_soon_threadsafe(settle, answer, self.engine.kv_state())

    def _take(self, add: _Add) -> None:
        """Hands an add to the engine; its caller hears the engine's ValueError, or that it was taken."""
        try:
            if add.request_id in self._streams:
                raise ValueError(f"request id {add.request_id!r} is already in use")
            self.engine.add_request(add.request_id, add.prompt, add.params, add.priority, add.session_id,
                                    add.end_session, add.tenant)
        except Exception as exc:
            add.stream.loop.call_soon_threadsafe(settle, add.accepted, None, exc)
            return
        finally:
            with self._pending_lock:
                self._num_pending_adds -= add.params.n
        self._streams[add.request_id] = add.stream
        add.stream.loop.call_soon_threadsafe(settle, add.accepted, None)
