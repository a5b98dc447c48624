"""Disaggregated prefill/decode: a prompt's KV blocks move from a prefill worker to a decode worker.

The flow (a router drives it: cluster/router.py):
1. The router names the transfer (a ``transfer_id``) and sends the request to both workers at once: to the prefill
   worker (`serve --role prefill`) with ``kv_transfer_params: {"do_remote_decode": true, "transfer_id": ...}`` and
   ``max_tokens: 1``; to the decode worker (`--role decode`) with ``{"do_remote_prefill": true, "transfer_id": ...,
   "remote_address": <the prefill worker's KV server>}`` (a prefill worker's /health says its address).
2. The prefill worker opens a hold for the transfer when the request reaches its engine core and adds the prompt's
   blocks to it as they fill, chunk by chunk; when the request ends the last (partial) block joins and the blocks are
   not freed but kept for the decode worker. The response carries the transfer's params as well (a caller without a
   router can run the two requests one after the other).
3. The decode worker looks up its own prefix cache and asks for the blocks it lacks at once: the prefill worker's
   KV server sends each block as soon as it is computed, so the transfer overlaps the prefill's later chunks (and the
   router's hop). Its step loop decodes its other requests meanwhile; once the blocks are here they are copied into
   blocks of its own, and it computes only the prompt's last token, whose logits pick the first output token as a
   single worker's would (the prefill worker's one token is not used: vLLM's choice too).
4. A fetch ends the hold; a finished hold nobody fetches is released after ``KVTransferConfig.timeout`` seconds (a
   decode worker that died frees the prefill side's blocks that way).

Whatever fails on the decode side (the prefill worker unreachable or gone, the hold expired or never opened, the
prefill request aborted or preempted, another prompt) falls back to computing the prompt there: slower, never wrong.
A layout that differs (another model, dtype, block size) fails the request with a clear error: that is a deployment
mistake, not a transient one.

The transport is one small interface (``KVConnector``) with one implementation over ZeroMQ/TCP; blocks travel as
raw bytes of the cache's own dtype, so a transfer adds no rounding.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import torch
import zmq

from serval.config import KVTransferConfig

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the KV server looks at its holds' deadlines while idle
BUSY_POLL_MS = 2  # ... and at its open holds' new blocks while a fetch waits on them
HEARTBEAT_S = 1.0  # a waiting fetch hears this often that the prefill worker is alive
OPEN_GRACE_S = 10.0  # how long an ask waits for its transfer's request to reach the prefill worker's core
FETCH_TIMEOUT_MS = 10_000  # a fetch that hears nothing for this long gives up (the prefill worker is gone)


def prompt_hash(token_ids: list[int]) -> str:
    """What ties a transfer to its prompt: a decode worker given another prompt must not use the blocks."""
    return hashlib.sha256(msgpack.packb(list(token_ids))).hexdigest()[:32]


@dataclass
class Hold:
    """A prefill's blocks for a decode worker: open while the request runs (``block_ids`` are those computed so
    far, still the request's), complete once it ended (all of them, kept for the decode worker)."""

    prompt_hash: str
    num_prompt_blocks: int
    block_ids: list[int] = field(default_factory=list)
    complete: bool = False
    failed: str | None = None  # why it will never complete (the request aborted, failed or was preempted)
    deadline: float = float("inf")  # time.monotonic() past which a complete hold nobody fetches is released
    sending: bool = False


@dataclass
class Ask:
    """A decode worker's ask, served block by block as the hold's blocks are computed."""

    identity: bytes
    transfer_id: str
    next_block: int
    end_block: int
    open_deadline: float  # the hold must be open by then
    started: bool = False  # the header went out
    last_sent: float = 0.0


@dataclass
class Fetch:
    """A decode worker's fetch of blocks ``[first_block, first_block + num_blocks)`` of a held prompt."""

    request_id: str
    first_block: int
    num_blocks: int
    staging: torch.Tensor | None = None  # [num_blocks, *block shape] of bytes, filled as messages come
    error: str | None = None
    fatal: bool = False  # the error is a deployment mistake (the layouts differ): fail the request, do not compute
    seconds: float = 0.0


@dataclass
class KVTransferStats:
    held_blocks: int = 0  # blocks held for decode workers now
    sent_blocks: int = 0
    sent_early_blocks: int = 0  # of those, sent before their request ended (while its later chunks computed)
    sent_bytes: int = 0
    expired_holds: int = 0
    received_blocks: int = 0
    received_bytes: int = 0
    failed_fetches: int = 0  # fetches that fell back to computing the prompt here
    fetches: int = 0  # fetches that brought their blocks
    fetch_seconds: float = 0.0  # their time, request sent to last block copied


class KVConnector:
    """One side's view of KV transfers. The step loop calls every method; transport threads stay inside."""

    def open(self, transfer_id: str, prompt_token_ids: list[int], block_size: int) -> str | None:
        """Opens a hold for a prefill request that just arrived; returns why it cannot be (the id is taken), or None."""
        raise NotImplementedError

    def progress(self, transfer_id: str, block_ids: list[int]) -> None:
        """The open hold's blocks computed so far (full blocks, in prompt order): they can be sent."""
        raise NotImplementedError

    def complete(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> dict | None:
        """The request ended: ``block_ids`` (all of its blocks) are kept for the decode worker; returns the
        kv_transfer_params that find them (None: the transfer ended already, the blocks are released)."""
        raise NotImplementedError

    def fail(self, transfer_id: str, reason: str) -> None:
        """The request will not complete (its blocks are freed by the caller): a fetch of it gets an error."""
        raise NotImplementedError

    def take_released(self) -> list[int]:
        """Blocks whose holds ended (fetched, or expired) since the last call: the caller frees them."""
        raise NotImplementedError

    def start_fetch(self, request_id: str, params: dict, first_block: int, num_blocks: int) -> None:
        """Starts fetching blocks of the transfer ``params`` names (0 blocks: only ends its hold)."""
        raise NotImplementedError

    def take_fetched(self) -> list[Fetch]:
        """Fetches that ended (with their blocks, or an error) since the last call."""
        raise NotImplementedError

    def check_params(self, params: dict) -> str | None:
        """Why these kv_transfer_params cannot be used here (a deployment mistake), or None."""
        raise NotImplementedError

    @property
    def num_fetching(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ZmqKVConnector(KVConnector):
    """Holds are served by a ZeroMQ ROUTER socket on tcp://host:port (prefill role); fetches are DEALER sockets, one
    per fetch, in a small thread pool (decode role). A fetch is a request message, then the answer's header, one
    message a block, and an end message: the receiver copies each block as it arrives."""

    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor, layout: dict) -> None:
        self.config = config
        self.role = config.role
        self.kv_bytes = kv_cache.view(torch.uint8)  # [layer, k/v, block, slot, kv head, row bytes]
        self.block_shape = tuple(self.kv_bytes[:, :, 0].shape)
        self.layout = {**layout, "block_shape": list(self.block_shape)}
        self.stats = KVTransferStats()
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # recent transfers that ended: why (answers asks at once)
        self._released: list[int] = []
        self._fetched: queue.Queue[Fetch] = queue.Queue()
        self._num_fetching = 0
        self._stop = threading.Event()
        self.address = None
        self._server = self._pool = None
        if self.role == "prefill":
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops messages past its high-water mark: queue them all
            if config.port:
                socket.bind(f"tcp://{config.host}:{config.port}")
                port = config.port
            else:
                port = socket.bind_to_random_port(f"tcp://{config.host}")
            self.address = f"tcp://{config.host}:{port}"
            self._server = threading.Thread(target=self._serve, args=(socket,), name="serval-kv-server",
                                            daemon=True)
            self._server.start()
            logger.info("KV transfer: prefill worker, serving held blocks at %s", self.address)
        elif self.role == "decode":
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="serval-kv-fetch")

    # -- prefill side ----------------------------------------------------------------------------------------------
    def open(self, transfer_id: str, prompt_token_ids: list[int], block_size: int) -> str | None:
        with self._lock:
            if transfer_id in self._holds:
                return f"kv_transfer_params.transfer_id {transfer_id!r} is already in use"
            self._holds[transfer_id] = Hold(prompt_hash(prompt_token_ids), -(-len(prompt_token_ids) // block_size))
        return None

    def progress(self, transfer_id: str, block_ids: list[int]) -> None:
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is not None and not hold.complete and len(block_ids) > len(hold.block_ids):
                hold.block_ids = list(block_ids)

    def complete(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> dict | None:
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is None:  # its fetch failed while the request ran: nobody will fetch these blocks
                self._released += list(block_ids)
                return None
            hold.block_ids, hold.complete = list(block_ids), True
            hold.deadline = time.monotonic() + self.config.timeout
            self.stats.held_blocks += len(block_ids)
            digest = hold.prompt_hash
        return {"remote_address": self.address, "transfer_id": transfer_id, "num_tokens": num_tokens,
                "prompt_hash": digest, "layout": self.layout}

    def fail(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is not None and not hold.complete:
                hold.failed, hold.block_ids = reason, []
                if not hold.sending:  # no ask waits on it: one that comes hears why at once
                    del self._holds[transfer_id]
                    self._remember(transfer_id, f"failed on the prefill worker: {reason}")

    def _remember(self, transfer_id: str, why: str) -> None:  # under the lock
        self._ended[transfer_id] = why
        while len(self._ended) > 4096:
            self._ended.popitem(last=False)

    def take_released(self) -> list[int]:
        now = time.monotonic()
        with self._lock:
            for transfer_id, hold in list(self._holds.items()):
                if hold.complete and not hold.sending and now > hold.deadline:
                    logger.warning("KV transfer %s: not fetched within %.0f s; its %d blocks are freed",
                                   transfer_id, self.config.timeout, len(hold.block_ids))
                    self._end_hold(transfer_id, f"not fetched within {self.config.timeout:.0f} s: released")
                    self.stats.expired_holds += 1
            released, self._released = self._released, []
        return released

    def _end_hold(self, transfer_id: str, why: str = "fetched already") -> None:  # under the lock
        hold = self._holds.pop(transfer_id)
        self._remember(transfer_id, why)
        if hold.complete:  # an open or failed hold's blocks are its request's
            self._released += hold.block_ids
            self.stats.held_blocks -= len(hold.block_ids)

    def _serve(self, socket: zmq.Socket) -> None:
        asks: list[Ask] = []
        try:
            while not self._stop.is_set():
                if socket.poll(BUSY_POLL_MS if asks else POLL_MS):
                    identity, raw = socket.recv_multipart()
                    try:
                        ask = msgpack.unpackb(raw)
                        asks.append(Ask(identity, str(ask.get("transfer_id")), int(ask.get("first_block", 0)),
                                        int(ask.get("first_block", 0)) + int(ask.get("num_blocks", 0)),
                                        time.monotonic() + OPEN_GRACE_S))
                    except Exception:  # noqa: BLE001 - one bad ask never stops the server
                        logger.exception("KV transfer: an ask that cannot be read")
                for ask in list(asks):
                    try:
                        done = self._advance(socket, ask)
                    except Exception:  # noqa: BLE001 - nor does a send that failed
                        logger.exception("KV transfer: answering a fetch failed")
                        done = True
                        with self._lock:
                            if ask.started and ask.transfer_id in self._holds:
                                self._end_hold(ask.transfer_id)
                    if done:
                        asks.remove(ask)
        finally:
            socket.close(linger=0)

    def _advance(self, socket: zmq.Socket, ask: Ask) -> bool:
        """Sends what of the ask is ready: its header once the hold is open, its blocks as they are computed, the
        end once the request ended (or an error). True when the ask is done."""
        now = time.monotonic()
        with self._lock:
            hold = self._holds.get(ask.transfer_id)
            error = None
            if hold is None:
                if ask.transfer_id in self._ended:
                    error = f"transfer {ask.transfer_id!r}: {self._ended[ask.transfer_id]}"
                elif ask.started or now > ask.open_deadline:
                    error = f"transfer {ask.transfer_id!r} is not held here (it never reached this prefill worker)"
            elif hold.failed is not None:
                error = f"transfer {ask.transfer_id!r} failed on the prefill worker: {hold.failed}"
                del self._holds[ask.transfer_id]
                self._remember(ask.transfer_id, f"failed on the prefill worker: {hold.failed}")
            elif not ask.started and (ask.next_block < 0 or ask.end_block > hold.num_prompt_blocks):
                error = f"blocks [{ask.next_block}, {ask.end_block}) asked; the prompt has {hold.num_prompt_blocks}"
            elif not ask.started and hold.sending:
                error = f"transfer {ask.transfer_id!r} is being fetched by another decode worker"
            if error is None and hold is not None:
                hold.sending = True
                ready = hold.block_ids[ask.next_block:ask.end_block]
                complete, digest = hold.complete, hold.prompt_hash
        if error is not None:
            socket.send_multipart([ask.identity, msgpack.packb({"error": error})])
            return True
        if hold is None:  # not open yet
            if now - ask.last_sent > HEARTBEAT_S:
                socket.send_multipart([ask.identity, b"wait"])
                ask.last_sent = now
            return False
        if not ask.started:
            socket.send_multipart([ask.identity, msgpack.packb({"num_blocks": ask.end_block - ask.next_block,
                                                                "prompt_hash": digest, "layout": self.layout})])
            ask.started, ask.last_sent = True, now
        sent = 0
        for block_id in ready:
            # A block in the hold is computed and written by nobody any more: reading it beside the step loop is
            # safe. (A hold failed meanwhile makes this read worthless: the error that follows discards it.)
            data = self.kv_bytes[:, :, block_id].contiguous().cpu().numpy()
            socket.send_multipart([ask.identity, data], copy=False)
            sent += data.nbytes
        ask.next_block += len(ready)
        with self._lock:
            self.stats.sent_blocks += len(ready)
            self.stats.sent_early_blocks += 0 if complete else len(ready)
            self.stats.sent_bytes += sent
        if ready:
            ask.last_sent = now
        if ask.next_block == ask.end_block and complete:
            socket.send_multipart([ask.identity, b"end"])
            with self._lock:
                self._end_hold(ask.transfer_id)
            return True
        if now - ask.last_sent > HEARTBEAT_S:
            socket.send_multipart([ask.identity, b"wait"])
            ask.last_sent = now
        return False

    # -- decode side -----------------------------------------------------------------------------------------------
    def check_params(self, params: dict) -> str | None:
        if self.role != "decode":
            return "this server is not a decode worker (serve --role decode)"
        missing = [k for k in ("remote_address", "transfer_id") if not isinstance(params.get(k), str)]
        if missing:
            return f"kv_transfer_params lacks {missing}"
        if "layout" in params and params["layout"] != self.layout:
            return self._layout_error(params["layout"])
        return None

    def _layout_error(self, layout) -> str:
        return (f"the prefill worker's KV layout {layout} differs from this decode worker's {self.layout}: both must "
                "serve the same model, dtype, KV cache dtype and block size")

    @property
    def num_fetching(self) -> int:
        return self._num_fetching

    def start_fetch(self, request_id: str, params: dict, first_block: int, num_blocks: int,
                    prompt_digest: str | None = None) -> None:
        fetch = Fetch(request_id, first_block, num_blocks)
        self._num_fetching += 1
        self._pool.submit(self._fetch, fetch, params["remote_address"], params["transfer_id"], prompt_digest)

    def _fetch(self, fetch: Fetch, address: str, transfer_id: str, prompt_digest: str | None) -> None:
        start = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        try:
            socket.connect(address)
            socket.send(msgpack.packb({"transfer_id": transfer_id, "first_block": fetch.first_block,
                                       "num_blocks": fetch.num_blocks}))
            header = None
            staging = torch.empty((fetch.num_blocks, *self.block_shape), dtype=torch.uint8)
            block_bytes = staging[0].numel() if fetch.num_blocks else 0
            received = 0
            while True:
                frame = self._recv(socket)
                if frame == b"wait":  # the prefill worker is alive; its request is queued or still computing
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the prompt's KV did not come within {self.config.timeout:.0f} s")
                    continue
                if header is None or len(frame) != block_bytes:
                    message = msgpack.unpackb(frame) if frame != b"end" else None
                    if isinstance(message, dict) and "error" in message:
                        raise RuntimeError(message["error"])
                    if header is None:
                        header = message or {}
                        if header.get("layout") != self.layout:
                            fetch.fatal = True
                            raise RuntimeError(self._layout_error(header.get("layout")))
                        if prompt_digest is not None and header.get("prompt_hash") != prompt_digest:
                            raise RuntimeError("the prefill worker holds the KV of another prompt")
                        continue
                    if frame == b"end" and received == fetch.num_blocks:
                        break
                    raise RuntimeError(f"block {received} came with {len(frame)} bytes, {block_bytes} expected")
                staging[received].view(-1).copy_(torch.frombuffer(frame, dtype=torch.uint8))
                received += 1
            fetch.staging = staging
        except Exception as exc:  # noqa: BLE001 - any failure falls back to computing the prompt here
            fetch.error = f"{type(exc).__name__}: {exc}"
        finally:
            socket.close()
            fetch.seconds = time.perf_counter() - start
            self._fetched.put(fetch)

    @staticmethod
    def _recv(socket: zmq.Socket) -> bytes:
        if not socket.poll(FETCH_TIMEOUT_MS):
            raise TimeoutError(f"no answer from the prefill worker in {FETCH_TIMEOUT_MS / 1000:.0f} s")
        return socket.recv(copy=False).buffer

    def take_fetched(self) -> list[Fetch]:
        done = []
        while True:
            try:
                fetch = self._fetched.get_nowait()
            except queue.Empty:
                break
            self._num_fetching -= 1
            if fetch.error is None:
                self.stats.received_blocks += fetch.num_blocks
                self.stats.received_bytes += fetch.staging.numel()
                self.stats.fetches += 1
                self.stats.fetch_seconds += fetch.seconds
            else:
                self.stats.failed_fetches += 1
            done.append(fetch)
        return done

    def load(self, staging: torch.Tensor, block_ids: list[int]) -> None:
        """Copies fetched blocks (rows of ``staging``) into the cache's ``block_ids``, before a forward reads them."""
        if block_ids:
            index = torch.tensor(block_ids, device=self.kv_bytes.device)
            self.kv_bytes.index_copy_(2, index, staging.to(self.kv_bytes.device).permute(1, 2, 0, 3, 4, 5))

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._context.destroy(linger=0)
