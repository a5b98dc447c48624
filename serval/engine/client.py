"""EngineClient: the one interface the server (and later a router) uses to reach an engine.

Two implementations: AsyncEngine (engine/async_engine.py) steps an LLMEngine on a thread of this process;
CoreProcessClient (engine/core_client.py) keeps the front end here and the EngineCore in its own process. Both
stream RequestOutputs into one asyncio queue per request; this base class owns those streams.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serval.engine.messages import EngineCoreStats
from serval.model.sampling_defaults import SamplingDefaults
from serval.outputs import RequestOutput
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

KV_STATE_TIMEOUT_S = 10.0  # how long GET /debug/kv waits for the engine (a step takes well under a second)


def settle(future: asyncio.Future, value, error: BaseException | None = None) -> None:
    """Sets a future's result, or ``error`` as its exception, unless it is done (its waiter timed out or was
    cancelled); call it on the future's loop."""
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class RequestStream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False


class EngineClient:
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    context_policy: str
    load_time: float
    kv_transfer_address: str | None = None  # a prefill worker's KV server (engine/kv_transfer.py)
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # for requests that leave sampling fields out
    error: BaseException | None = None

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self.dead = threading.Event()  # set once the engine has died and every open stream has heard it

    # -- what each implementation provides -----------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, session_id: str | None = None,
                          end_session: bool = False, tenant: str = "") -> RequestStream:
        """Queues a request; raises ValueError for bad input and EngineDeadError when no engine runs.
        ``session_id``: the conversation it is a turn of (its KV is kept for the next turn unless
        ``end_session``). ``tenant``: whose request (server/tenancy.py); tenants' waiting requests take turns."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def end_session(self, session_id: str) -> None:
        """Lets a conversation's kept KV go (asynchronously; an unknown session is ignored)."""
        raise NotImplementedError

    async def kv_state(self) -> dict:
        """The KV cache's blocks, prefix cache and sessions, read by the engine between two steps."""
        raise NotImplementedError

    def snapshot(self) -> EngineCoreStats:
        """The engine's counters and gauges now (approximate: read without stopping the engine)."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------------------------
    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, session_id: str | None = None,
                       end_session: bool = False, tenant: str = "") -> AsyncIterator[RequestOutput]:
        """Queues a request and yields its outputs until the final one. Raises ValueError (bad input) before the
        first output. Leaving the loop early (client gone, task cancelled) aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority, session_id, end_session, tenant)
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

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, finished: bool) -> None:
        """Hands an output (or the error that ends the stream) to its request's queue; callable from any thread."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if finished:
            stream.finished = True
            self._streams.pop(request_id, None)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def abort_all(self) -> None:
        """Aborts every open request: each stream ends with its final output (finish_reason "abort")."""
        for request_id in list(self._streams):
            self.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        """The engine died: every open stream ends with ``error``, and ``dead`` is set (the server then exits)."""
        for request_id in list(self._streams):
            self._deliver(request_id, error, True)
        self.dead.set()
