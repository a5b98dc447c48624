"""The scheduler's side of disaggregated prefill/decode (kv_transfer.py says the flow): which requests hold their
KV for a decode worker or fetch it from a prefill worker, and what the step does about them. The transport, the
worker's side, is a KVConnector (kv_transfer.ZmqKVConnector, built by the Worker over its KV cache).

EngineCore calls it at fixed points of a step (``poll`` before scheduling, ``after_schedule``, ``loads``,
``finished`` and ``progress`` after the update, ``released`` when a request ends). An engine that is neither a
prefill nor a decode worker has ``NO_KV_TRANSFER``, whose calls do nothing.
"""

from __future__ import annotations

import logging
import uuid

from serval.engine.kv_cache import KVCacheManager
from serval.engine.kv_transfer import prompt_hash
from serval.engine.request import RemoteKV, Request
from serval.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class KVTransferScheduler:
    def __init__(self, connector, role: str, kv_cache: KVCacheManager) -> None:
        self.connector = connector  # a KVConnector (kv_transfer.py)
        self.role = role
        self.kv_cache = kv_cache

    @property
    def address(self) -> str | None:
        return self.connector.address

    @property
    def stats(self):
        return self.connector.stats

    def start(self, request: Request, params: dict) -> str | None:
        """A prefill worker's request keeps its KV when it ends; a decode worker's fetches what its prefix cache
        lacks of the prompt's KV. Returns why the params cannot be used here (the request's error), or None."""
        if params.get("do_remote_decode"):
            if self.role != "prefill":
                return "kv_transfer_params.do_remote_decode needs a prefill worker (serve --role prefill)"
            transfer_id = params.get("transfer_id") or f"{request.request_id}-{uuid.uuid4().hex[:8]}"
            error = self.connector.open(transfer_id, request.prompt_token_ids, self.kv_cache.block_size)
            if error is None:
                request.transfer_id = transfer_id
            return error
        if not params.get("do_remote_prefill"):
            return "kv_transfer_params must say do_remote_decode or do_remote_prefill"
        error = self.connector.check_params(params)
        if error is not None:
            return error
        self._start_fetch(request, params)
        return None

    def _start_fetch(self, request: Request, params: dict) -> None:
        block_size = self.kv_cache.block_size
        num_tokens = request.num_prompt_tokens - 1  # the last prompt token is computed here: its logits sample
        hits, _ = self.kv_cache.get_computed_blocks(request)
        first, last = len(hits), -(-num_tokens // block_size)
        digest = prompt_hash(request.prompt_token_ids)
        # Params from a finished prefill say which prompt they hold; a router's (sent before the prefill ran) do
        # not, and the prefill worker's answer says it instead (the fetch checks it).
        usable = params.get("prompt_hash", digest) == digest and \
            int(params.get("num_tokens", num_tokens)) >= num_tokens and request.sampling_params.prompt_logprobs is None
        if not usable:
            logger.warning("request %s: the held KV is of another prompt (or prompt logprobs are asked); "
                           "computing the prompt here", request.request_id)
        if not usable or first >= last:  # nothing to fetch: end the hold once the prefill is done
            self.connector.start_fetch(request.request_id, params, 0, 0)
            return
        request.remote_kv = RemoteKV(num_tokens, first)
        self.connector.start_fetch(request.request_id, params, first, last - first, digest)

    def poll(self, requests: dict[str, Request]) -> tuple[bool, list[tuple[Request, str]]]:
        """Frees the blocks of holds that ended; hands fetched blocks to their waiting ``requests`` (a failed fetch:
        the prompt is computed here). Returns whether blocks were freed, and the requests whose fetch failed for
        good (a layout that differs) with their error: the caller fails them."""
        released = self.connector.take_released()
        if released:
            self.kv_cache.pool.release(released)
        failed = []
        for fetch in self.connector.take_fetched():
            request = requests.get(fetch.request_id)
            if request is None or request.remote_kv is None:
                continue  # aborted while fetching, or a fetch that only ended a hold
            if fetch.fatal:
                failed.append((request, fetch.error))
            elif fetch.error is not None:
                logger.warning("request %s: fetching its prompt's KV failed (%s); computing the prompt here",
                               fetch.request_id, fetch.error)
                request.remote_kv = None
            else:
                request.remote_kv.staging = fetch.staging
        return bool(released), failed

    def after_schedule(self, scheduled: SchedulerOutput) -> bool:
        """Fails the transfers of preempted requests (their blocks were freed). True when the step has nothing to
        run but requests waiting for their prompt's KV."""
        for request in scheduled.preempted:
            if request.transfer_id is not None:
                self.connector.fail(request.transfer_id, "the request was preempted")
                request.transfer_id = None
        return not scheduled.scheduled and self.connector.num_fetching > 0

    def loads(self, scheduled: SchedulerOutput) -> None:
        """Copies the fetched prompt KV the step's requests start from into their blocks."""
        for staging, block_ids in scheduled.kv_loads:
            self.connector.load(staging, block_ids)

    def finished(self, request: Request) -> dict | None:
        """A prefill that ended with its blocks held: the params a decode worker fetches them with."""
        if not request.held_block_ids:
            return None
        params = self.connector.complete(request.transfer_id, request.held_block_ids, request.num_computed_tokens)
        request.held_block_ids, request.transfer_id = [], None
        return params

    def progress(self, scheduled: SchedulerOutput) -> None:
        """A prefill's full blocks computed so far can go to the decode worker."""
        block_size = self.kv_cache.block_size
        for request in scheduled.scheduled:
            if request.transfer_id is not None and not request.status.finished:
                self.connector.progress(request.transfer_id,
                                        request.block_ids[:request.num_computed_tokens // block_size])

    def released(self, request: Request) -> None:
        """A prefill that ends without its blocks held (aborted, failed): its transfer fails."""
        if request.transfer_id is not None:
            self.connector.fail(request.transfer_id, f"the request ended ({request.status.value})")
            request.transfer_id = None

    def close(self) -> None:
        self.connector.close()


class NoKVTransfer:
    """Neither a prefill nor a decode worker: a request's kv_transfer_params are refused, the rest does nothing."""

    address = None
    stats = None

    def start(self, request: Request, params: dict) -> str | None:
        if params.get("do_remote_decode"):
            return "kv_transfer_params.do_remote_decode needs a prefill worker (serve --role prefill)"
        if not params.get("do_remote_prefill"):
            return "kv_transfer_params must say do_remote_decode or do_remote_prefill"
        return "kv_transfer_params.do_remote_prefill needs a decode worker (serve --role decode)"

    def poll(self, requests: dict[str, Request]) -> tuple[bool, list[tuple[Request, str]]]:
        return False, []

    def after_schedule(self, scheduled: SchedulerOutput) -> bool:
        return False

    def loads(self, scheduled: SchedulerOutput) -> None:
        pass

    def finished(self, request: Request) -> dict | None:
        return None

    def progress(self, scheduled: SchedulerOutput) -> None:
        pass

    def released(self, request: Request) -> None:
        pass

    def close(self) -> None:
        pass


NO_KV_TRANSFER = NoKVTransfer()
