"""Disaggregated prefill/decode: a prompt's KV blocks move from a prefill worker to a decode worker.

The flow (a router drives it: cluster/router.py):
1. The prefill worker (`serve --role prefill`) gets the request with ``kv_transfer_params: {"do_remote_decode":
   true}`` and ``max_tokens: 1``. It computes the prompt as any request; when the request ends its blocks are not
   freed but held (``KVConnector.hold``), and the response carries where to fetch them: this worker's KV server
   address, a transfer id, the number of tokens, the cache layout and a hash of the prompt's token ids.
2. The decode worker (`--role decode`) gets the same request with those params and ``"do_remote_prefill": true``.
   Its own prefix cache may hold the prompt's first blocks; it fetches the others (``KVConnector.start_fetch``),
   one ZeroMQ message a block, in a background thread while its step loop goes on, copies them into blocks of its
   own and computes only the prompt's last token, whose logits pick the first output token as a single worker's
   would (the prefill worker's one token is not used: vLLM's choice too).
3. A fetch ends the hold; a hold nobody fetches is released after ``KVTransferConfig.timeout`` seconds (a decode
   worker that died frees the prefill side's blocks that way).

Whatever fails on the decode side (the prefill worker unreachable or gone, the hold expired, another prompt) falls
back to computing the prompt there: slower, never wrong. A layout that differs (another model, dtype, block size)
fails the request with a clear error: that is a deployment mistake, not a transient one.

The transport is one small interface (``KVConnector``) with one implementation over ZeroMQ/TCP; blocks travel as
raw bytes of the cache's own dtype, so a transfer adds no rounding.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgpack
import torch
import zmq

from serval.config import KVTransferConfig

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the KV server looks at its holds' deadlines while idle
FETCH_TIMEOUT_MS = 10_000  # a fetch that hears nothing for this long gives up (the prefill worker is gone)


def prompt_hash(token_ids: list[int]) -> str:
    """What ties a transfer to its prompt: a decode worker given another prompt must not use the blocks."""
    return hashlib.sha256(msgpack.packb(list(token_ids))).hexdigest()[:32]


@dataclass
class Hold:
    """A finished prefill's blocks, kept for a decode worker."""

    block_ids: list[int]
    deadline: float  # time.monotonic()
    sending: bool = False


@dataclass
class Fetch:
    """A decode worker's fetch of blocks ``[first_block, first_block + num_blocks)`` of a held prompt."""

    request_id: str
    first_block: int
    num_blocks: int
    staging: torch.Tensor | None = None  # [num_blocks, *block shape] of bytes, filled as messages come
    error: str | None = None
    seconds: float = 0.0


@dataclass
class KVTransferStats:
    held_blocks: int = 0  # blocks held for decode workers now
    sent_blocks: int = 0
    sent_bytes: int = 0
    expired_holds: int = 0
    received_blocks: int = 0
    received_bytes: int = 0
    failed_fetches: int = 0  # fetches that fell back to computing the prompt here
    fetches: int = 0  # fetches that brought their blocks
    fetch_seconds: float = 0.0  # their time, request sent to last block copied


class KVConnector:
    """One side's view of KV transfers. The step loop calls every method; transport threads stay inside."""

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, prompt_token_ids: list[int]) -> dict:
        """Keeps a finished request's blocks for a decode worker; returns the kv_transfer_params that find them."""
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
    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, prompt_token_ids: list[int]) -> dict:
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            self._holds[transfer_id] = Hold(list(block_ids), time.monotonic() + self.config.timeout)
            self.stats.held_blocks += len(block_ids)
        return {"remote_address": self.address, "transfer_id": transfer_id, "num_tokens": num_tokens,
                "prompt_hash": prompt_hash(prompt_token_ids), "layout": self.layout}

    def take_released(self) -> list[int]:
        now = time.monotonic()
        with self._lock:
            for transfer_id, hold in list(self._holds.items()):
                if not hold.sending and now > hold.deadline:
                    logger.warning("KV transfer %s: not fetched within %.0f s; its %d blocks are freed",
                                   transfer_id, self.config.timeout, len(hold.block_ids))
                    self._end_hold(transfer_id)
                    self.stats.expired_holds += 1
            released, self._released = self._released, []
        return released

    def _end_hold(self, transfer_id: str) -> None:  # under the lock
        hold = self._holds.pop(transfer_id)
        self._released += hold.block_ids
        self.stats.held_blocks -= len(hold.block_ids)

    def _serve(self, socket: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not socket.poll(POLL_MS):
                    continue
                identity, raw = socket.recv_multipart()
                try:
                    self._answer(socket, identity, msgpack.unpackb(raw))
                except Exception:  # noqa: BLE001 - one bad ask (or a send that failed) never stops the server
                    logger.exception("KV transfer: answering a fetch failed")
        finally:
            socket.close(linger=0)

    def _answer(self, socket: zmq.Socket, identity: bytes, ask: dict) -> None:
        transfer_id = ask.get("transfer_id")
        first, count = int(ask.get("first_block", 0)), int(ask.get("num_blocks", 0))
        with self._lock:
            hold = self._holds.get(transfer_id)
            error = None
            if hold is None:
                error = f"transfer {transfer_id!r} is not held here (fetched already, or expired)"
            elif first < 0 or first + count > len(hold.block_ids):
                error = f"blocks [{first}, {first + count}) asked; the transfer holds {len(hold.block_ids)}"
            else:
                hold.sending = True
        if error is not None:
            socket.send_multipart([identity, msgpack.packb({"error": error})])
            return
        socket.send_multipart([identity, msgpack.packb({"num_blocks": count})])
        sent = 0
        try:
            for block_id in hold.block_ids[first:first + count]:
                # The held blocks are written by nobody while held: reading them beside the step loop is safe.
                data = self.kv_bytes[:, :, block_id].contiguous().cpu().numpy()
                socket.send_multipart([identity, data], copy=False)
                sent += data.nbytes
            socket.send_multipart([identity, b"end"])
        finally:
            with self._lock:
                self._end_hold(transfer_id)
                self.stats.sent_blocks += count
                self.stats.sent_bytes += sent

    # -- decode side -----------------------------------------------------------------------------------------------
    def check_params(self, params: dict) -> str | None:
        if self.role != "decode":
            return "this server is not a decode worker (serve --role decode)"
        missing = [k for k in ("remote_address", "transfer_id", "num_tokens", "layout") if k not in params]
        if missing:
            return f"kv_transfer_params lacks {missing}"
        if params["layout"] != self.layout:
            return (f"the prefill worker's KV layout {params['layout']} differs from this decode worker's "
                    f"{self.layout}: both must serve the same model, dtype, KV cache dtype and block size")
        return None

    @property
    def num_fetching(self) -> int:
        return self._num_fetching

    def start_fetch(self, request_id: str, params: dict, first_block: int, num_blocks: int) -> None:
        fetch = Fetch(request_id, first_block, num_blocks)
        self._num_fetching += 1
        self._pool.submit(self._fetch, fetch, params["remote_address"], params["transfer_id"])

    def _fetch(self, fetch: Fetch, address: str, transfer_id: str) -> None:
        start = time.perf_counter()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        try:
            socket.connect(address)
            socket.send(msgpack.packb({"transfer_id": transfer_id, "first_block": fetch.first_block,
                                       "num_blocks": fetch.num_blocks}))
            header = msgpack.unpackb(self._recv(socket))
            if "error" in header:
                raise RuntimeError(header["error"])
            staging = torch.empty((fetch.num_blocks, *self.block_shape), dtype=torch.uint8)
            block_bytes = staging[0].numel() if fetch.num_blocks else 0
            for i in range(fetch.num_blocks):
                frame = self._recv(socket)
                if len(frame) != block_bytes:
                    raise RuntimeError(f"block {i} came with {len(frame)} bytes, {block_bytes} expected")
                staging[i].view(-1).copy_(torch.frombuffer(frame, dtype=torch.uint8))
            if self._recv(socket) != b"end":
                raise RuntimeError("the transfer did not end where expected")
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
