"""Token-budget continuous batching.

Each step packs running requests first (decodes and unfinished prompt chunks), then admits waiting
ones, under ``max_num_batched_tokens`` and ``max_num_seqs``. A long prompt is cut into chunks so it
never stalls running decodes. When blocks run out, the least important (highest priority value), newest running
request is preempted: its blocks are freed and it is recomputed later (its generated tokens are kept), or, in swap
mode, its KV is parked in the second tier and copied back when it runs again. A waiting request of higher priority
(a lower value) than a running one preempts it when there is no seat or no room.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serval.config import SchedulerConfig
from serval.engine.kv_cache import ComputedBlocks, KVCacheManager
from serval.engine.request import Request, RequestStatus
from serval.sampling_params import samples_without_the_host


@dataclass
class SchedulerOutput:
    """The step's plan for the runner: which requests run and how many new tokens each."""

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # Requests that check guessed tokens this step (speculative decoding): their guesses, which are part of their
    # num_scheduled_tokens (1 + len(guesses)).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Prompt KV fetched from a prefill worker, to copy into these blocks before the forward: (blocks as rows of a
    # byte tensor, block ids).
    kv_loads: list[tuple[object, list[int]]] = field(default_factory=list)
    # Multi-step decoding (SchedulerConfig.num_scheduler_steps): a step of decodes only (each row's token drawn from
    # its logits alone) that runs this many forwards in a row, each one's tokens the next one's inputs; every
    # request's num_scheduled_tokens is this.
    num_decode_steps: int = 1

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class PreemptionCosts:
    """What a preemption costs each way, measured as the engine runs (seconds; None until measured)."""

    copy_per_block: float | None = None  # one block between the tiers, either way
    compute_per_token: float | None = None  # one token through the model in a step with a prompt chunk

    def swap_is_cheaper(self, num_tokens: int, block_size: int) -> bool:
        if self.copy_per_block is None or self.compute_per_token is None:
            return True  # a copy is bytes; a recompute is the whole model per token
        blocks = -(-num_tokens // block_size)
        return 2 * blocks * self.copy_per_block < num_tokens * self.compute_per_token

    @staticmethod
    def average(old: float | None, new: float) -> float:
        return new if old is None else 0.9 * old + 0.1 * new


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_decode_steps: int | None = None) -> None:
        """``max_decode_steps``: the forwards of decodes the worker runs in a row (Worker.max_decode_steps); None:
        the config's num_scheduler_steps."""
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Request] = []
        self._tenant_turns: dict[str, int] = {}  # tenant -> the number of its latest admission
        self._num_admissions = 0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions that swapped the request's KV out instead of dropping it
        self.costs = PreemptionCosts()
        # The one place that decides multi-step runs (the plan of each step: _plan_decode_run, schedule_next_run)
        # within what the worker stated it runs in a row.
        self.max_decode_steps = config.num_scheduler_steps if max_decode_steps is None else max_decode_steps

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.kv_cache.expire_sessions()

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new == 0:
                continue
            if request.spec_token_ids:  # a decode with guesses: room for them too, else a plain decode
                guesses = request.spec_token_ids[: budget - num_new]
                if guesses and self.kv_cache.allocate_slots(request, num_new + len(guesses)):
                    request.spec_token_ids = guesses
                    out.scheduled.append(request)
                    out.num_scheduled_tokens[request.request_id] = num_new + len(guesses)
                    out.spec_token_ids[request.request_id] = guesses
                    budget -= num_new + len(guesses)
                    continue
                request.spec_token_ids = []
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self._least_important_running()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim.request_id in out.num_scheduled_tokens:  # it already had a place in this step
                    out.scheduled.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

        while self.waiting and budget > 0:
            request = self._next_waiting()
            if request is None:
                break
            # No seat or no blocks to spare: only a more important request gets in, by preempting a lesser one.
            if (len(self.running) >= self.config.max_num_seqs or out.preempted) and not self._outranks(request):
                break
            resumes = bool(request.swapped_slots)  # where it was: its blocks come back from the second tier
            if resumes:
                hit_blocks, num_hit_tokens = ComputedBlocks(), request.num_computed_tokens
            else:
                hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_loaded = self._num_remote_tokens(request, hit_blocks, num_hit_tokens)
            while True:
                num_new = self._num_new_tokens(request, num_hit_tokens + num_loaded, budget)
                if num_new == 0:
                    break
                if len(self.running) < self.config.max_num_seqs and \
                        self.kv_cache.allocate_slots(request, num_loaded + num_new, hit_blocks):
                    break
                if not self._outranks(request):
                    num_new = 0
                    break
                victim = self._least_important_running()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim.request_id in out.num_scheduled_tokens:
                    out.scheduled.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
            if num_new == 0:
                break
            self.waiting.remove(request)
            self._tenant_turns[request.tenant] = self._num_admissions  # its turn is taken
            self._num_admissions += 1
            if not resumes:
                self.kv_cache.record_prefix_query(request, num_hit_tokens)
                self.kv_cache.record_offload_hit(hit_blocks)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens + num_loaded
            if num_loaded:  # the fetched blocks this worker's cache lacks go into the request's new blocks
                remote, first = request.remote_kv, len(hit_blocks)
                last = -(-remote.num_tokens // self.kv_cache.block_size)
                out.kv_loads.append((remote.staging[first - remote.first_block:], request.block_ids[first:last]))
            request.remote_kv = None
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        if self.max_decode_steps > 1 and not out.preempted:
            self._plan_decode_run(out)
        return out

    def _plan_decode_run(self, out: SchedulerOutput) -> None:
        """Makes a step of decodes only (every request past its prompt, with no guesses, no grammar and a token drawn
        from its logits alone: greedy or sampled, with logprobs if asked, without penalties) run several forwards in
        a row, as many as every request still may take tokens and has KV room for without preempting anyone;
        otherwise leaves the step as it is. A request that stops inside the run has its tokens after the stop dropped
        (update_from_output), like rejected guesses."""
        counts = out.num_scheduled_tokens
        if not out.scheduled or out.spec_token_ids or out.kv_loads:
            return
        for request in out.scheduled:
            if counts[request.request_id] != 1 or request.num_computed_tokens + 1 != request.num_tokens \
                    or request.max_tokens == 0 or not _samples_on_the_device(request):
                return
        steps = min(self.max_decode_steps, self.config.max_num_batched_tokens // len(out.scheduled),
                    *(r.max_tokens - len(r.output_token_ids) for r in out.scheduled))
        if steps < 2 or not all(self.kv_cache.allocate_slots(r, steps, may_end_sessions=False)
                                for r in out.scheduled):
            return  # room taken for some requests stays with them: their next steps' slots
        out.num_decode_steps = steps
        for request in out.scheduled:
            counts[request.request_id] = steps

    def schedule_next_run(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling: the run of decodes to follow the run ``out`` (``num_decode_steps`` forwards of
        decodes), decided before its tokens are known, so that the device computes it while the host reads
        ``out``'s. It takes every running request, as ``out`` did, for as many forwards as each may still take after
        ``out`` (a stop inside ``out`` is found later: ``update_from_output`` then skips the finished request).
        None, and the host reads ``out``'s tokens first, when something else needs the step: a waiting request that
        could get in (a free seat, or a priority over a running one), a request that left the batch, a token budget
        or a KV cache without room (a queued run never preempts)."""
        requests = out.scheduled
        if not requests or len(requests) != len(self.running) \
                or any(r.status != RequestStatus.RUNNING for r in requests):
            return None
        if self.waiting and (len(self.running) < self.config.max_num_seqs
                             or any(self._outranks(r) for r in self.waiting)):
            return None
        done = out.num_decode_steps
        steps = min(self.max_decode_steps, self.config.max_num_batched_tokens // len(requests),
                    *(r.max_tokens - len(r.output_token_ids) - done for r in requests))
        if steps < 1 or not all(self.kv_cache.allocate_slots(r, done + steps, may_end_sessions=False)
                                for r in requests):
            return None  # room taken for some requests stays with them: their next steps' slots
        return SchedulerOutput(scheduled=list(requests), num_scheduled_tokens={r.request_id: steps for r in requests},
                               num_decode_steps=steps)

    def _num_remote_tokens(self, request: Request, hit_blocks: ComputedBlocks, num_hit_tokens: int) -> int:
        """Prompt tokens past the prefix cache's hit whose KV a fetch from a prefill worker brought (0: none, or
        the cache lost blocks the fetch skipped since it started, and the prompt is computed here instead)."""
        remote = request.remote_kv
        if remote is None or remote.staging is None:
            return 0
        if len(hit_blocks) < remote.first_block:
            request.remote_kv = None
            return 0
        return max(0, remote.num_tokens - num_hit_tokens)

    def _swaps(self, request: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "auto":
            return self.costs.swap_is_cheaper(request.num_computed_tokens, self.kv_cache.block_size)
        return mode == "swap"

    def _least_important_running(self) -> Request:
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))

    def _outranks(self, request: Request) -> bool:
        """A waiting request may preempt a running one only of strictly lower priority (a higher value)."""
        return bool(self.running) and request.priority < self._least_important_running().priority

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advances the scheduled requests by what was computed; appends sampled tokens and checks stops.

        ``sampled``: each request's new tokens (one, or with guesses the accepted ones and the one after; the
        guesses not accepted leave their KV slots to be overwritten). Returns the requests that got new tokens
        (finished ones included), and those with max_tokens 0 whose prompt is now computed: they end there, with
        no token ("length")."""
        updated = []
        for request in out.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(request.request_id) or [] if request.max_tokens > 0 else []  # 0: scores the prompt
            guesses = out.spec_token_ids.get(request.request_id, ())
            rejected = len(guesses) - (len(tokens) - 1) if tokens and guesses else len(guesses)
            request.spec_token_ids = []
            status = None
            for token in tokens:  # accepted guesses are computed tokens: appended before the blocks are hashed
                request.output_token_ids.append(token)
                status = request.check_stop()
                if status is not None:
                    break  # a stop among the accepted guesses: what follows it is dropped
            computed = request.num_computed_tokens + out.num_scheduled_tokens[request.request_id] - rejected
            request.num_computed_tokens = min(computed, request.num_tokens)
            self.kv_cache.cache_computed_blocks(request)
            if rejected:
                self.kv_cache.trim(request)
            if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish_request(request, status)
            if tokens or status is not None:  # a prompt chunk that is not the last one has nothing to report
                updated.append(request)
        return updated

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Ends a request (stop, length, abort, error) and frees its blocks; a finished request is left alone."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request.session_id is not None:  # a conversation's turn: its KV stays for the next turn, or is let go
            if request.keep_session and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.kv_cache.pin_session(request.session_id, request)
            elif not request.keep_session:
                self.kv_cache.end_session(request.session_id)
        ended_well = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if request.transfer_id is not None and ended_well:  # a prefill worker's: kept for a decode worker
            request.held_block_ids, request.block_ids = request.block_ids, []
        self.kv_cache.free(request)
        request.status = status
        del self.requests[request.request_id]

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        remaining = request.num_tokens - num_computed
        if not self.config.enable_chunked_prefill and remaining > budget:
            # Unchunked, a prompt runs whole. A preempted request that outgrew the whole step budget would then
            # never run again, so its recompute is chunked anyway.
            if request.num_preemptions == 0 or remaining <= self.config.max_num_batched_tokens:
                return 0
        return min(remaining, budget)

    def _next_waiting(self) -> Request | None:
        block_size = self.kv_cache.block_size
        # A group's leader is a running sibling computing prompt blocks the cache did not have.
        leaders_prefilling = {r.group_id for r in self.running
                              if r.group_id is not None and r.num_computed_tokens < r.num_prompt_tokens
                              and r.num_cached_tokens < (r.num_prompt_tokens - 1) // block_size * block_size}
        candidates = [r for r in self.waiting
                      # n > 1: siblings wait until the first one's prompt is cached, then share its blocks.
                      if not (self.kv_cache.enable_prefix_caching and r.group_id in leaders_prefilling)
                      # Its prompt's KV is still on the way from a prefill worker.
                      and not (r.remote_kv is not None and r.remote_kv.staging is None)]
        # Of equal priority, the tenant whose last admission is oldest goes first: tenants take turns, so one
        # key's backlog never starves another's (with one tenant, this is arrival order).
        return min(candidates, key=lambda r: (r.priority, self._tenant_turns.get(r.tenant, -1), r.arrival_time),
                   default=None)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        if self._swaps(request) and self.kv_cache.swap_out(request):
            self.num_swaps += 1
        else:
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)


def _samples_on_the_device(request: Request) -> bool:
    """Whether the request's next tokens are each drawn from its logits alone (``samples_without_the_host``), past
    min_tokens (no id blocked) and under no grammar: such tokens can be fed back on the device without the host
    looking at them."""
    params = request.sampling_params
    return samples_without_the_host(params) and len(request.output_token_ids) >= params.min_tokens \
        and params.structured_outputs is None
