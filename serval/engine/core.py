"""EngineCore: the step loop on token ids only: schedule (scheduler.py), execute (the Worker's runner), update.

It knows nothing of text: requests come in as token ids with resolved limits, and every step hands back, for all
requests at once, the new token ids, their logprobs and the finish reasons. The front end (engine/frontend.py)
tokenizes, detokenizes, checks stop strings and builds outputs. The same core runs inside LLMEngine (offline,
tests) and in its own process for `serve` (engine/core_process.py); what crosses is engine/messages.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from serval.config import EngineConfig
from serval.engine.grammar_scheduler import GrammarScheduler
from serval.engine.kv_cache import KVCacheManager
from serval.engine.kv_offload import OffloadIndex
from serval.engine.kv_transfer_scheduler import NO_KV_TRANSFER, KVTransferScheduler
from serval.engine.messages import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
)
from serval.engine.request import Request, RequestStatus
from serval.engine.runner import LaunchedRun, ModelRunnerOutput
from serval.engine.scheduler import Scheduler, SchedulerOutput
from serval.engine.spec_decode import Speculator
from serval.engine.worker import Worker

logger = logging.getLogger(__name__)

# Steps of at least this many tokens (a prompt chunk's) time the model per token, for the preemption mode's choice.
PROMPT_CHUNK_TIMING_TOKENS = 32


class EngineCore:
    def __init__(self, config: EngineConfig, model_path: str, model=None) -> None:
        """Loads the model at ``model_path`` (or reuses an already loaded ``model`` of the same dtype and device)."""
        start = time.perf_counter()
        self.config = config = config.settled()  # the device, the dtype and their defaults decided here
        if config.enable_expert_parallel and config.tensor_parallel_size == 1:
            logger.warning("--enable-expert-parallel does nothing on one rank: every expert is on this rank (it "
                           "places whole experts on the ranks of --tensor-parallel-size > 1)")
        self.worker = worker = Worker(config, model_path, model)
        self.model, self.runner = worker.model, worker.runner  # for tests and tools that look inside
        cache = config.cache
        self.offload_store = worker.offload_store()
        offload = None
        if self.offload_store is not None:
            entries = self.offload_store.entries()
            if entries:
                logger.info("KV offload tier %s: %d blocks kept from an earlier run", cache.kv_offload_path,
                            len(entries))
            offload = OffloadIndex(self.offload_store.num_slots, entries)
        self.kv_cache = KVCacheManager(worker.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                       cache.session_ttl, cache.session_cache_fraction, offload)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, worker.max_decode_steps)
        connector = worker.kv_transfer()
        self.kv_transfer = NO_KV_TRANSFER if connector is None else \
            KVTransferScheduler(connector, config.kv_transfer.role, self.kv_cache)
        self.stats = EngineCoreStats(num_blocks=worker.num_blocks)
        self.stats.spec_accepted_per_position = [0] * config.speculative.num_speculative_tokens
        self.speculator = None if worker.proposer is None else Speculator(config.speculative, worker.proposer,
                                                                           self.stats)
        self.max_model_len = worker.max_model_len
        self.info = EngineCoreInfo(str(model_path), self.max_model_len, self.model.config.vocab_size,
                                   worker.num_blocks, 0.0, config.scheduler.max_num_batched_tokens,
                                   self.kv_transfer.address)
        self.grammars = GrammarScheduler(str(model_path), self.info.vocab_size,
                                         config.structured_outputs.compile_timeout_s)
        self._requests: dict[str, Request] = {}
        self._unreported: set[str] = set()  # requests whose first scheduling the front end has not heard of yet
        self._pending: list[EngineCoreOutput] = []  # outputs of requests that ended outside a step
        self._launched: LaunchedRun | None = None  # a run queued by async scheduling, read by the next step
        self.info.load_time = time.perf_counter() - start

    @property
    def dot_products(self) -> str:
        """How the CPU block kernel multiplies (EngineConfig.block_dot_products, "auto" resolved)."""
        return self.model.dot_products

    def _transfer(self) -> None:
        """Makes the copies between the KV tiers that the last allocations asked for (before any forward uses or
        overwrites the blocks), and times them for the preemption mode's choice."""
        transfers = self.kv_cache.take_transfers()
        if transfers is None:
            return
        start = time.perf_counter()
        self.offload_store.execute(transfers, self.runner.kv_cache)
        costs = self.scheduler.costs
        costs.copy_per_block = costs.average(costs.copy_per_block,
                                             (time.perf_counter() - start) / transfers.num_blocks)

    def shutdown(self) -> None:
        """Ends the core's hold on its files and processes: a disk tier first takes every cached block the device
        holds, so that the next run starts with the whole prefix cache; model-parallel ranks stop."""
        self.worker.shutdown()
        self.kv_transfer.close()
        self.kv_transfer = NO_KV_TRANSFER
        if self.offload_store is None:
            return
        if self.offload_store.kind == "disk":
            self.kv_cache.offload_cached_blocks()
            self._transfer()
        self.offload_store.close()
        self.offload_store = None

    # -- requests in -------------------------------------------------------------------------------------------
    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queues a request. A duplicate id or a grammar that does not compile fails that request alone (an error
        output), never the core. A request with a grammar waits outside the scheduler until its grammar has
        compiled (on a compile thread: the steps of the others go on)."""
        self.stats.num_received_requests += 1
        request_id = core_request.request_id
        error = None
        if request_id in self._requests or request_id in self.grammars.waiting:
            error = f"request id {request_id!r} is already in use"
        elif not core_request.prompt_token_ids:  # never queued: no step would ever schedule it
            error = "the prompt has no tokens"
        request = Request(request_id, list(core_request.prompt_token_ids), core_request.params,
                          frozenset(core_request.eos_token_ids), core_request.max_tokens, core_request.priority,
                          group_id=core_request.group_id, arrival_time=core_request.arrival_time,
                          session_id=core_request.session_id, keep_session=core_request.keep_session,
                          tenant=core_request.tenant)
        if error is not None:
            self._pending.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))
        elif core_request.params.structured_outputs is not None:
            self.grammars.submit(request)
        else:
            self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Hands a request (its grammar, if any, compiled) to the scheduler, or fails it alone."""
        request_id = request.request_id
        kv_transfer_params = request.sampling_params.kv_transfer_params
        error = self.kv_transfer.start(request, kv_transfer_params) if kv_transfer_params else None
        if error is not None:
            self.grammars.remove(request_id)
            self._pending.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))
            return
        self._requests[request_id] = request
        self._unreported.add(request_id)
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ends requests now and frees their blocks: aborts, and stop strings the front end found. Silent: the front
        end that asked has finished them already. Unknown or finished ids are ignored."""
        for request_id in request_ids:
            if self.grammars.drop_waiting(request_id):  # ended while its grammar compiled
                self.stats.num_finished_requests += 1
                continue
            request = self._requests.get(request_id)
            if request is None:
                continue
            self.scheduler.finish_request(request, status)
            if request.held_block_ids:  # a stop string cut the prefill: its transfer fails, the blocks are freed
                self.kv_cache.pool.release(request.held_block_ids)
                request.held_block_ids = []
            self._release(request)

    def poll_kv_transfers(self) -> bool:
        """Frees the blocks of KV holds that ended and hands fetched blocks to their requests (kv_transfer_scheduler.
        py); a fetch that failed for good fails its request. True when blocks were freed."""
        freed, failed = self.kv_transfer.poll(self._requests)
        for request, error in failed:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            self._release(request)
            self._pending.append(EngineCoreOutput(request.request_id, [], finish_reason="error", error=error))
        return freed

    def kv_state(self) -> dict:
        """The KV cache's blocks, prefix cache and sessions now (GET /debug/kv); sessions past their TTL end first
        (otherwise they end at the next step, which an idle engine does not take)."""
        self.kv_cache.expire_sessions()
        kind = self.offload_store.kind if self.offload_store is not None else "host"
        return self.kv_cache.describe(str(self.config.device), kind)

    def end_session(self, session_id: str) -> bool:
        """Lets a conversation's kept KV go (to the prefix cache, as free blocks). False: no such session."""
        return self.kv_cache.end_session(session_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or bool(self.grammars.waiting) \
            or self._launched is not None

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self, while_device_runs: Callable[[], None] | None = None) -> EngineCoreOutputs:
        """One iteration: schedule, run the batch, advance the requests. Returns an output for every request that
        got tokens, prompt logprobs or a finish reason, and the core's counters. ``while_device_runs``: host work
        the runner does while the device computes the step's tokens, if the step samples any (ModelRunner.execute);
        it must not touch this core."""
        outputs = self._outputs_between_steps()
        scheduled = self._schedule_step()
        if scheduled is None:
            return EngineCoreOutputs(outputs, self.snapshot())
        step_outputs = StepOutputs(scheduled, self._unreported)
        result = self._execute(scheduled, step_outputs, while_device_runs)
        if result is not None:
            self._update(scheduled, result, step_outputs)
        return EngineCoreOutputs(outputs + step_outputs.values(), self.snapshot())

    def _outputs_between_steps(self) -> list[EngineCoreOutput]:
        """What came since the last step (ended KV holds, fetched KV, compiled grammars), and the outputs of the
        requests that ended outside a step."""
        self.poll_kv_transfers()
        if self.grammars.waiting:
            ready, failed = self.grammars.take_compiled(
                wait=not self.scheduler.has_unfinished_requests() and not self._pending)
            for request in ready:
                self._schedule(request)
            for request_id, error in failed.items():
                self._pending.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))
        outputs, self._pending = self._pending, []
        return outputs

    def _schedule_step(self) -> SchedulerOutput | None:
        """The step's plan: the scheduler's, or the run the last step queued; None when there is nothing to run."""
        if self._launched is not None:  # the run the last step queued: this step reads it (async scheduling)
            scheduled = self._launched.out
        elif not self.scheduler.has_unfinished_requests():
            return None
        else:
            scheduled = self.scheduler.schedule()
        if self.kv_transfer.after_schedule(scheduled):
            time.sleep(0.001)  # every request waits for its prompt's KV: nothing to run yet
            return None
        return scheduled

    def _execute(self, scheduled: SchedulerOutput, outputs: StepOutputs,
                 while_device_runs: Callable[[], None] | None) -> ModelRunnerOutput | None:
        """The step's KV copies, forwards and sampling. A failed forward fails its batch, never the engine: None."""
        self._transfer()
        self.kv_transfer.loads(scheduled)
        stats = self.stats
        stats.num_steps += 1
        stats.num_scheduled_tokens += scheduled.total_num_scheduled_tokens
        stats.last_batch_size = len(scheduled.scheduled)
        stats.last_batch_tokens = scheduled.total_num_scheduled_tokens
        grammar_bitmasks, grammar_errors = self.grammars.bitmasks(scheduled)
        try:
            forward_start = time.perf_counter()
            result = self._run(scheduled, grammar_bitmasks, while_device_runs)
            if scheduled.total_num_scheduled_tokens >= PROMPT_CHUNK_TIMING_TOKENS \
                    and scheduled.num_decode_steps == 1:  # what a recompute would cost
                costs = self.scheduler.costs
                costs.compute_per_token = costs.average(
                    costs.compute_per_token,
                    (time.perf_counter() - forward_start) / scheduled.total_num_scheduled_tokens)
        except Exception as exc:
            logger.exception("step failed; failing its %d requests", len(scheduled.scheduled))
            self._launched = None  # a run queued after it holds the same requests
            for request in scheduled.scheduled:
                if not request.status.finished:
                    self._fail(request, f"internal error: {exc}", outputs)
            return None
        for request_id, chunk in result.prompt_logprobs.items():
            outputs.of(outputs.scheduled[request_id]).prompt_logprobs = chunk
        for request_id, error in grammar_errors.items():  # sampled unconstrained this step: fail it, alone
            result.sampled_token_ids.pop(request_id, None)
            self._fail(outputs.scheduled[request_id], error, outputs)
        return result

    def _update(self, scheduled: SchedulerOutput, result: ModelRunnerOutput, outputs: StepOutputs) -> None:
        """Advances the step's requests by what it sampled (their tokens, grammars and ends), then what follows a
        step: a prefill's computed KV offered to its decode worker, the guesses counted and the next ones made."""
        before = {r.request_id: len(r.output_token_ids) for r in scheduled.scheduled}
        for request in self.scheduler.update_from_output(scheduled, result.sampled_token_ids):
            out = outputs.of(request)
            new_tokens = request.output_token_ids[before[request.request_id]:]
            if new_tokens:
                out.new_token_ids += new_tokens
                self.stats.num_generated_tokens += len(new_tokens)
                logprobs = result.logprobs.get(request.request_id)
                if logprobs is not None:
                    out.new_logprobs = logprobs[: len(new_tokens)]
                if request.request_id in self.grammars:
                    out.error = self.grammars.advance(request, new_tokens, self.scheduler)
            if request.status.finished:
                out.finish_reason = request.status.value
                out.stop_reason = request.stop_reason
                out.kv_transfer_params = self.kv_transfer.finished(request)
                self._release(request)
        self.kv_transfer.progress(scheduled)
        if self.speculator is not None:
            self.speculator.count_accepted(scheduled.spec_token_ids, result.sampled_token_ids)
            self.speculator.propose(self.scheduler.running, self.kv_cache, self.max_model_len, self._transfer,
                                    self.grammars.valid_prefix)

    def _fail(self, request: Request, error: str, outputs: StepOutputs) -> None:
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        self._release(request)
        out = outputs.of(request)
        out.finish_reason, out.error = "error", error

    def _run(self, scheduled: SchedulerOutput, grammar_bitmasks: dict,
             while_device_runs: Callable[[], None] | None) -> ModelRunnerOutput:
        """The step's forwards and what they sampled. With async scheduling a run of decodes (multi-step
        decoding) is launched here, or was queued by the last step, and the run that follows it (the same requests)
        is queued before its tokens are read, so the device computes that run while the host checks stops, reports
        and schedules: the host's step costs the device no idle time. A request that stopped in a run has its part
        of the queued run dropped. Any other step is the runner's ``execute``."""
        run, self._launched = self._launched, None
        queues_runs = self.config.scheduler.async_scheduling and self._may_queue_runs()
        if run is None and queues_runs:
            run = self.runner.launch_run(scheduled)
        if run is None:  # the step as the runner runs it (its multi-step runs launched and read at once)
            return self.runner.execute(scheduled, grammar_bitmasks, while_device_runs)
        if queues_runs:
            following = self.scheduler.schedule_next_run(scheduled)
            if following is not None:
                self._launched = self.runner.launch_next_run(run, following)
        if while_device_runs is not None:
            while_device_runs()
        return self.runner.finish_run(run)

    def _may_queue_runs(self) -> bool:
        """Whether a run may be queued before the last one's tokens are read: nothing waits on those tokens but its
        own requests' stops (no guesses to propose from them, no KV copies between tiers or workers)."""
        return (self.kv_transfer is NO_KV_TRANSFER and self.kv_cache.offload is None
                and (self.speculator is None or not self.speculator.pays(len(self.scheduler.running))))

    def _release(self, request: Request) -> None:
        self.kv_transfer.released(request)
        self._requests.pop(request.request_id, None)
        self.grammars.remove(request.request_id)
        self._unreported.discard(request.request_id)
        self.stats.num_finished_requests += 1

    def snapshot(self) -> EngineCoreStats:
        s, kv, scheduler = self.stats, self.kv_cache, self.scheduler
        s.num_running, s.num_waiting = len(scheduler.running), len(scheduler.waiting) + len(self.grammars.waiting)
        s.num_free_blocks, s.kv_cache_usage = kv.pool.num_free_blocks, kv.usage
        s.prefix_cache_queried_tokens, s.prefix_cache_hit_tokens = kv.stats.queried_tokens, kv.stats.hit_tokens
        s.session_requests, s.session_hit_tokens = kv.stats.session_requests, kv.stats.session_hit_tokens
        s.num_sessions, s.session_blocks = len(kv.sessions), kv.num_session_blocks
        s.num_preemptions, s.num_swaps = scheduler.num_preemptions, scheduler.num_swaps
        if kv.offload is not None:
            tier = kv.offload
            s.offload_saved_blocks, s.offload_loaded_blocks = tier.stats.saved_blocks, tier.stats.loaded_blocks
            s.offload_hit_tokens, s.offload_blocks = tier.stats.hit_tokens, tier.num_slots
            s.offload_cached_blocks, s.offload_swapped_blocks = len(tier.cached), tier.num_swapped
        if self.kv_transfer.stats is not None:
            t = self.kv_transfer.stats
            s.kv_held_blocks, s.kv_sent_blocks, s.kv_sent_bytes = t.held_blocks, t.sent_blocks, t.sent_bytes
            s.kv_received_blocks, s.kv_received_bytes = t.received_blocks, t.received_bytes
            s.kv_expired_holds, s.kv_failed_fetches = t.expired_holds, t.failed_fetches
            s.kv_fetches, s.kv_fetch_seconds = t.fetches, t.fetch_seconds
            s.kv_sent_early_blocks = t.sent_early_blocks
        return EngineCoreStats(**{**s.__dict__, "spec_accepted_per_position": list(s.spec_accepted_per_position)})


class StepOutputs:
    """The outputs of one step's requests: one per request, made when first needed; a request scheduled for the
    first time says when (its queue time ends there)."""

    def __init__(self, scheduled: SchedulerOutput, unreported: set[str]) -> None:
        self.scheduled = {r.request_id: r for r in scheduled.scheduled}
        self._by_id: dict[str, EngineCoreOutput] = {}
        step_start = time.monotonic()
        for request in scheduled.scheduled:
            if request.request_id in unreported:
                unreported.discard(request.request_id)
                self.of(request).first_scheduled_time = step_start

    def of(self, request: Request) -> EngineCoreOutput:
        out = self._by_id.get(request.request_id)
        if out is None:
            out = self._by_id[request.request_id] = EngineCoreOutput(
                request.request_id, [], num_cached_tokens=max(0, request.num_cached_tokens))
        return out

    def values(self) -> list[EngineCoreOutput]:
        return list(self._by_id.values())
