"""A request's state as the scheduler sees it: token ids, progress, blocks. Plain data, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from serval.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class RemoteKV:
    """A decode worker's request whose prompt KV comes from a prefill worker (engine/kv_transfer.py)."""

    num_tokens: int  # prompt tokens whose KV is fetched or found locally: all but the last
    first_block: int  # the first block fetched; the ones before it are in this worker's prefix cache
    staging: Any = None  # the fetched blocks (a tensor) once here; None while the fetch runs


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = DEFAULT_MAX_TOKENS  # resolved: never past the context window
    priority: int = 0  # lower runs first
    group_id: str | None = None  # the n > 1 siblings of one prompt share it
    session_id: str | None = None  # a conversation whose KV outlives the request (KVCacheManager.pin_session)
    keep_session: bool = True  # False: the conversation's last turn, its session ends with it
    tenant: str = ""  # whose request: waiting requests of equal priority are taken a tenant at a time, in turn
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of full blocks, grown as tokens arrive
    num_cached_blocks: int = 0  # leading blocks already published to the prefix cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first scheduling
    num_preemptions: int = 0
    swapped_slots: list[int] = field(default_factory=list)  # second-tier slots of its KV while swapped out
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    spec_token_ids: list[int] = field(default_factory=list)  # guessed next tokens, checked by the next step
    # Disaggregated prefill/decode: a prefill worker's request that names a transfer (``transfer_id``) offers its
    # blocks as they are computed and keeps them when it ends (``held_block_ids``); a decode worker's request may
    # wait for its prompt's KV (``remote_kv``).
    transfer_id: str | None = None
    held_block_ids: list[int] = field(default_factory=list)
    remote_kv: RemoteKV | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def check_stop(self) -> RequestStatus | None:
        """After a token was appended: did a stop token or a length limit end the request?"""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
