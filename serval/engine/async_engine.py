"""AsyncEngine: the step loop in one background thread, per-request async streams, abort.

Only the engine thread touches the LLMEngine. Callers talk to it through a command queue (add, abort) and
get outputs through one asyncio queue per request. The model's matmuls release the GIL, so the event loop
(HTTP, JSON, SSE) keeps running while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serval.config import EngineConfig
from serval.engine.engine import LLMEngine
from serval.outputs import RequestOutput
from serval.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class EngineSnapshot:
    """What the engine is doing right now, for metrics and the live view (read without locks: approximate)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    last_batch_size: int
    last_batch_tokens: int


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Adds sent to the engine thread that it has not taken yet: they are waiting too, or a burst arriving
        # within one step would all see an empty queue and slip past load shedding.
        self._num_pending_adds = 0
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by start() for a thread that loaded the engine and waits
        self.error: BaseException | None = None
        self.last_batch_size = 0
        self.last_batch_tokens = 0
        self.last_step_time = time.monotonic()

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
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queues a request and yields its outputs until the final one. Raises ValueError (bad input) before the
        first output. Leaving the loop early (client gone, task cancelled) aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0) -> _Stream:
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(asyncio.Queue(), loop)
        with self._pending_lock:
            self._num_pending_adds += 1
        self._commands.put(("add", request_id, prompt, params, priority, stream, accepted))
        self._wake.set()
        try:
            await accepted  # raises the engine's ValueError for bad input
        except asyncio.CancelledError:  # the caller left before the engine took the request
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def snapshot(self) -> EngineSnapshot:
        e = self.engine
        kv = e.kv_cache
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting) + self._num_pending_adds,
            kv_cache_usage=kv.usage, num_blocks=kv.num_blocks, num_free_blocks=kv.pool.num_free_blocks,
            prefix_cache_queried_tokens=kv.stats.queried_tokens, prefix_cache_hit_tokens=kv.stats.hit_tokens,
            num_preemptions=e.scheduler.num_preemptions, num_steps=e.stats.num_steps,
            last_batch_size=self.last_batch_size, last_batch_tokens=self.last_batch_tokens,
        )

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.last_step_time = time.monotonic()
                self.last_batch_size = len(self.engine.scheduler.running)
                for output in outputs:
                    self._deliver(output.request_id, output, output.finished)
        except BaseException as exc:  # the loop is dead: every waiting caller must hear it
            logger.exception("engine loop died")
            self.error = exc
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine loop died: {exc}"), True)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, priority, stream, accepted = command
                try:
                    if request_id in self._streams:
                        raise ValueError(f"request id {request_id!r} is already in use")
                    self.engine.add_request(request_id, prompt, params, priority)
                except Exception as exc:
                    stream.loop.call_soon_threadsafe(_settle, accepted, exc)
                    continue
                finally:
                    with self._pending_lock:
                        self._num_pending_adds -= 1
                self._streams[request_id] = stream
                stream.loop.call_soon_threadsafe(_settle, accepted, None)
            elif command[0] == "abort":
                if command[1] in self._streams:
                    self.engine.abort_request(command[1])

    def _deliver(self, request_id: str, item, finished: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if finished:
            stream.finished = True
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
