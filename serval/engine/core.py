"""EngineCore: the step loop on token ids only (scheduler + runner + KV cache manager).

It knows nothing of text: requests come in as token ids with resolved limits, and every step hands back, for all
requests at once, the new token ids, their logprobs and the finish reasons. The front end (engine/frontend.py)
tokenizes, detokenizes, checks stop strings and builds outputs. The same core runs inside LLMEngine (offline,
tests) and in its own process for `serve` (engine/core_process.py); what crosses is engine/messages.py's.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from serval.config import EngineConfig
from serval.engine.cuda_graphs import DecodeBuckets
from serval.engine.kv_cache import KVCacheManager
from serval.engine.kv_offload import BlockStore, OffloadIndex
from serval.engine.kv_transfer import KVConnector, ZmqKVConnector, prompt_hash
from serval.engine.memory_profile import num_kv_blocks
from serval.engine.messages import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
)
from serval.engine.request import RemoteKV, Request, RequestStatus
from serval.engine.runner import LaunchedRun, ModelRunner, ModelRunnerOutput, kv_cache_block_bytes
from serval.engine.scheduler import Scheduler, SchedulerOutput
from serval.engine.spec_decode import NgramProposer
from serval.engine.workers import start_ranks
from serval.layers.linear import use_activation_quantization, use_dot_products
from serval.model.llama import use_cpu_layers
from serval.model.loader import has_4bit_blocks, load_model
from serval.model.registry import resolve_model_path

logger = logging.getLogger(__name__)

# Steps of at least this many tokens (a prompt chunk's) time the model per token, for the preemption mode's choice.
PROMPT_CHUNK_TIMING_TOKENS = 32
# With nothing to run but grammars compiling, a step waits this long for one (rather than spin) and returns.
GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig, model_path: str, model=None) -> None:
        """Loads the model at ``model_path`` (or reuses an already loaded ``model`` of the same dtype and device)."""
        start = time.perf_counter()
        self.config = config = config.settled()  # the device, the dtype and their defaults decided here
        # Model parallelism: this process is rank 0 (schedules, samples); the other ranks follow its steps.
        if model is not None and config.world_size > 1:
            raise ValueError("a loaded model cannot be split over ranks: let the engine load it")
        self.ranks = start_ranks(config, str(model_path)) if config.world_size > 1 else None
        self.group = self.ranks.group if self.ranks is not None else None
        self.model = model or load_model(model_path, config.torch_dtype, config.device, config.quantization,
                                         self.group, config.enable_expert_parallel)
        use_activation_quantization(self.model, config.activation_quantization)  # a model given too
        self.dot_products = use_dot_products(self.model, config.block_dot_products)  # "auto" resolved
        use_cpu_layers(self.model, not config.enforce_eager)
        model_config = self.model.config
        cache = config.cache
        num_blocks = num_kv_blocks(config, self.model)  # on a GPU, after a profiling forward of the largest step
        if self.group is not None:
            self.group.broadcast(num_blocks)
        # A request alone must always fit, or preemption could never make room for it.
        max_model_len = min(config.max_model_len or model_config.max_position, num_blocks * cache.block_size)
        self.runner = ModelRunner(self.model, num_blocks, cache.block_size, config.kv_cache_torch_dtype,
                                  config.device, self.group, self._decode_buckets(max_model_len))
        self.kv_transfer: KVConnector | None = None
        if config.kv_transfer.role != "both":
            self.kv_transfer = ZmqKVConnector(config.kv_transfer, self.runner.kv_cache,
                                              {**self._fingerprint(model_path), "block_size": cache.block_size})
        self.offload_store, offload = self._make_offload_tier(model_path)
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                       cache.session_ttl, cache.session_cache_fraction, offload)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.stats = EngineCoreStats(num_blocks=num_blocks)
        self.max_model_len = max_model_len
        self.speculative = config.speculative
        self.info = EngineCoreInfo(str(model_path), max_model_len, model_config.vocab_size, num_blocks, 0.0,
                                   config.scheduler.max_num_batched_tokens,
                                   self.kv_transfer.address if self.kv_transfer is not None else None)
        self.proposer = self._make_proposer(config)
        if self.runner.draft is not None or self.group is not None:  # they follow the forwards one at a time
            self.scheduler.max_decode_steps = 1
        self.stats.spec_accepted_per_position = [0] * config.speculative.num_speculative_tokens
        self.structured = None  # StructuredOutputManager, once a grammar needs it (_structured_outputs)
        self._structured_lock = threading.Lock()  # prepare_structured_outputs makes it on a thread
        self._grammar_waiting: dict[str, Request] = {}  # requests whose grammar compiles: not scheduled yet
        self._requests: dict[str, Request] = {}
        self._unreported: set[str] = set()  # requests whose first scheduling the front end has not heard of yet
        self._pending: list[EngineCoreOutput] = []  # outputs of requests that ended outside a step
        self._launched: LaunchedRun | None = None  # a run queued by async scheduling, read by the next step
        self.info.load_time = time.perf_counter() - start

    def _decode_buckets(self, max_model_len: int) -> DecodeBuckets | None:
        """Padded decode buckets (captured in CUDA graphs) on a GPU, unless --enforce-eager; model-parallel ranks run
        eagerly."""
        config = self.config
        on_gpu = config.device.startswith("cuda")
        if config.enforce_eager or self.group is not None or not (on_gpu or config.pad_decode_on_cpu):
            return None
        return DecodeBuckets(config.scheduler.max_num_seqs, max_model_len, capture=on_gpu,
                             multi_step=config.scheduler.num_scheduler_steps > 1)

    def _make_offload_tier(self, model_path) -> tuple[BlockStore | None, OffloadIndex | None]:
        cache = self.config.cache
        if not cache.kv_offload_size:
            return None, None
        block_bytes = kv_cache_block_bytes(self.model.config, cache.block_size, self.config.kv_cache_torch_dtype)
        num_slots = int(cache.kv_offload_size * 2**30 // block_bytes)
        if num_slots < 1:
            raise ValueError(f"CacheConfig.kv_offload_size={cache.kv_offload_size} GiB holds no KV block "
                             f"({block_bytes} bytes)")
        # What the blocks of a disk tier are worth to a later run: the same weights, read the same way.
        store = BlockStore(num_slots, self.runner.kv_cache, cache.kv_offload_path, self._fingerprint(model_path))
        entries = store.entries()
        if entries:
            logger.info("KV offload tier %s: %d blocks kept from an earlier run", cache.kv_offload_path, len(entries))
        return store, OffloadIndex(num_slots, entries)

    def _fingerprint(self, model_path) -> dict:
        """What KV blocks depend on: the same weights read the same way, and the cache's own dtype."""
        path = Path(model_path)
        return {"model": path.name, "bytes": path.stat().st_size if path.is_file() else None,
                "dtype": self.config.dtype, "quantization": self.config.quantization,
                "kv_cache_dtype": self.config.cache.kv_cache_dtype,
                "activation_quantization": self.config.activation_quantization, "dot_products": self.dot_products}

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
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = self.group = None
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None
        if self.offload_store is None:
            return
        if self.offload_store.kind == "disk":
            self.kv_cache.offload_cached_blocks()
            self._transfer()
        self.offload_store.close()
        self.offload_store = None

    # -- requests in -------------------------------------------------------------------------------------------
    def prepare_structured_outputs(self) -> None:
        """Imports xgrammar and builds the grammar compiler on a thread now (the server's core, once loaded), not
        when the first request with a grammar comes: the import alone took 0.7 s, and on the step loop it stood
        every stream still."""
        threading.Thread(target=lambda: self._structured_outputs().prepare(), name="serval-grammar-setup",
                         daemon=True).start()

    def _structured_outputs(self):
        """The StructuredOutputManager, made at the first call (xgrammar is imported then)."""
        with self._structured_lock:
            if self.structured is None:
                from serval.engine.structured_output import GrammarCompiler, StructuredOutputManager

                model_path, vocab_size = self.info.model_path, self.info.vocab_size
                self.structured = StructuredOutputManager(lambda: GrammarCompiler.for_model(model_path, vocab_size),
                                                          vocab_size, self.config.structured_outputs.compile_timeout_s)
            return self.structured

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queues a request. A duplicate id or a grammar that does not compile fails that request alone (an error
        output), never the core. A request with a grammar waits outside the scheduler until its grammar has
        compiled (on a compile thread: the steps of the others go on)."""
        self.stats.num_received_requests += 1
        request_id = core_request.request_id
        error = None
        if request_id in self._requests or request_id in self._grammar_waiting:
            error = f"request id {request_id!r} is already in use"
        request = Request(request_id, list(core_request.prompt_token_ids), core_request.params,
                          frozenset(core_request.eos_token_ids), core_request.max_tokens, core_request.priority,
                          group_id=core_request.group_id, arrival_time=core_request.arrival_time,
                          session_id=core_request.session_id, keep_session=core_request.keep_session,
                          tenant=core_request.tenant)
        if error is not None:
            self._pending.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))
        elif core_request.params.structured_outputs is not None:
            self._grammar_waiting[request_id] = request
            self._structured_outputs().submit(request_id, core_request.params.structured_outputs)
        else:
            self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Hands a request (its grammar, if any, compiled) to the scheduler, or fails it alone."""
        request_id = request.request_id
        error = None
        kv_transfer_params = request.sampling_params.kv_transfer_params
        if kv_transfer_params:
            error = self._start_kv_transfer(request, kv_transfer_params)
        if error is not None:
            if request_id in self.structured_ids:
                self.structured.remove(request_id)
            self._pending.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))
            return
        self._requests[request_id] = request
        self._unreported.add(request_id)
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ends requests now and frees their blocks: aborts, and stop strings the front end found. Silent: the front
        end that asked has finished them already. Unknown or finished ids are ignored."""
        for request_id in request_ids:
            if self._grammar_waiting.pop(request_id, None) is not None:  # ended while its grammar compiled
                self.structured.remove(request_id)
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

    # -- disaggregated prefill/decode --------------------------------------------------------------------------
    def _start_kv_transfer(self, request: Request, params: dict) -> str | None:
        """A prefill worker's request keeps its KV when it ends; a decode worker's fetches what its prefix cache
        lacks of the prompt's KV. Returns why the params cannot be used here (the request's error), or None."""
        role = self.config.kv_transfer.role
        if params.get("do_remote_decode"):
            if role != "prefill":
                return "kv_transfer_params.do_remote_decode needs a prefill worker (serve --role prefill)"
            transfer_id = params.get("transfer_id") or f"{request.request_id}-{uuid.uuid4().hex[:8]}"
            error = self.kv_transfer.open(transfer_id, request.prompt_token_ids, self.kv_cache.block_size)
            if error is None:
                request.transfer_id = transfer_id
            return error
        if not params.get("do_remote_prefill"):
            return "kv_transfer_params must say do_remote_decode or do_remote_prefill"
        if self.kv_transfer is None:
            return "kv_transfer_params.do_remote_prefill needs a decode worker (serve --role decode)"
        error = self.kv_transfer.check_params(params)
        if error is not None:
            return error
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
            self.kv_transfer.start_fetch(request.request_id, params, 0, 0)
            return None
        request.remote_kv = RemoteKV(num_tokens, first)
        self.kv_transfer.start_fetch(request.request_id, params, first, last - first, digest)
        return None

    def poll_kv_transfers(self) -> bool:
        """Frees the blocks of holds that ended; hands fetched blocks to their waiting requests (a failed fetch:
        the prompt is computed here). True when blocks were freed."""
        if self.kv_transfer is None:
            return False
        released = self.kv_transfer.take_released()
        if released:
            self.kv_cache.pool.release(released)
        for fetch in self.kv_transfer.take_fetched():
            request = self._requests.get(fetch.request_id)
            if request is None or request.remote_kv is None:
                continue  # aborted while fetching, or a fetch that only ended a hold
            if fetch.fatal:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
                self._release(request)
                self._pending.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                      error=fetch.error))
            elif fetch.error is not None:
                logger.warning("request %s: fetching its prompt's KV failed (%s); computing the prompt here",
                               fetch.request_id, fetch.error)
                request.remote_kv = None
            else:
                request.remote_kv.staging = fetch.staging
        return bool(released)

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
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or bool(self._grammar_waiting) \
            or self._launched is not None

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self, while_device_runs: Callable[[], None] | None = None) -> EngineCoreOutputs:
        """One iteration: schedule, run the batch, advance the requests. Returns an output for every request that
        got tokens, prompt logprobs or a finish reason, and the core's counters. ``while_device_runs``: host work
        the runner does while the device computes the step's tokens, if the step samples any (ModelRunner.execute);
        it must not touch this core."""
        self.poll_kv_transfers()
        if self._grammar_waiting:
            if not self.scheduler.has_unfinished_requests() and not self._pending:
                self.structured.wait_compiled(GRAMMAR_WAIT_S)
            self._take_compiled_grammars()
        outputs, self._pending = self._pending, []
        if self._launched is not None:  # the run the last step queued: this step reads it (async scheduling)
            scheduled = self._launched.out
        elif not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(outputs, self.snapshot())
        else:
            scheduled = self.scheduler.schedule()
        for request in scheduled.preempted:  # its blocks were freed: the transfer they were offered to fails
            if request.transfer_id is not None:
                self.kv_transfer.fail(request.transfer_id, "the request was preempted")
                request.transfer_id = None
        if not scheduled.scheduled and self.kv_transfer is not None and self.kv_transfer.num_fetching:
            time.sleep(0.001)  # every request waits for its prompt's KV: nothing to run yet
            return EngineCoreOutputs(outputs, self.snapshot())
        self._transfer()
        for staging, block_ids in scheduled.kv_loads:
            self.kv_transfer.load(staging, block_ids)
        stats = self.stats
        stats.num_steps += 1
        stats.num_scheduled_tokens += scheduled.total_num_scheduled_tokens
        stats.last_batch_size = len(scheduled.scheduled)
        stats.last_batch_tokens = scheduled.total_num_scheduled_tokens
        step_start = time.monotonic()
        by_id: dict[str, EngineCoreOutput] = {}

        def output_of(request: Request) -> EngineCoreOutput:
            out = by_id.get(request.request_id)
            if out is None:
                out = by_id[request.request_id] = EngineCoreOutput(
                    request.request_id, [], num_cached_tokens=max(0, request.num_cached_tokens))
            return out

        for request in scheduled.scheduled:
            if request.request_id in self._unreported:
                self._unreported.discard(request.request_id)
                output_of(request).first_scheduled_time = step_start
        grammar_bitmasks, grammar_errors = self._grammar_bitmasks(scheduled)
        try:
            forward_start = time.perf_counter()
            result = self._run(scheduled, grammar_bitmasks, while_device_runs)
            if scheduled.total_num_scheduled_tokens >= PROMPT_CHUNK_TIMING_TOKENS \
                    and scheduled.num_decode_steps == 1:  # what a recompute would cost
                costs = self.scheduler.costs
                costs.compute_per_token = costs.average(
                    costs.compute_per_token,
                    (time.perf_counter() - forward_start) / scheduled.total_num_scheduled_tokens)
        except Exception as exc:  # a failed forward fails its batch, never the engine
            logger.exception("step failed; failing its %d requests", len(scheduled.scheduled))
            self._launched = None  # a run queued after it holds the same requests
            for request in scheduled.scheduled:
                if request.status.finished:
                    continue
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
                self._release(request)
                out = output_of(request)
                out.finish_reason, out.error = "error", f"internal error: {exc}"
            return EngineCoreOutputs(outputs + list(by_id.values()), self.snapshot())
        scheduled_by_id = {r.request_id: r for r in scheduled.scheduled}
        for request_id, chunk in result.prompt_logprobs.items():
            output_of(scheduled_by_id[request_id]).prompt_logprobs = chunk
        for request_id, error in grammar_errors.items():  # sampled unconstrained this step: fail it, alone
            result.sampled_token_ids.pop(request_id, None)
            request = scheduled_by_id[request_id]
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            self._release(request)
            out = output_of(request)
            out.finish_reason, out.error = "error", error
        before = {r.request_id: len(r.output_token_ids) for r in scheduled.scheduled}
        for request in self.scheduler.update_from_output(scheduled, result.sampled_token_ids):
            out = output_of(request)
            new_tokens = request.output_token_ids[before[request.request_id]:]
            if new_tokens:
                out.new_token_ids += new_tokens
                stats.num_generated_tokens += len(new_tokens)
                logprobs = result.logprobs.get(request.request_id)
                if logprobs is not None:
                    out.new_logprobs = logprobs[: len(new_tokens)]
                if request.request_id in self.structured_ids:
                    out.error = self._advance_grammar(request, new_tokens)
            if request.status.finished:
                out.finish_reason = request.status.value
                out.stop_reason = request.stop_reason
                if request.held_block_ids:
                    out.kv_transfer_params = self.kv_transfer.complete(
                        request.transfer_id, request.held_block_ids, request.num_computed_tokens)
                    request.held_block_ids, request.transfer_id = [], None
                self._release(request)
        if self.kv_transfer is not None:  # a prefill's full blocks computed so far can go to the decode worker
            block_size = self.kv_cache.block_size
            for request in scheduled.scheduled:
                if request.transfer_id is not None and not request.status.finished:
                    self.kv_transfer.progress(request.transfer_id,
                                              request.block_ids[:request.num_computed_tokens // block_size])
        self._count_accepted(scheduled, result.sampled_token_ids)
        if self.proposer is not None:
            self._propose()
        return EngineCoreOutputs(outputs + list(by_id.values()), self.snapshot())

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
        return (self.kv_transfer is None and self.kv_cache.offload is None
                and (self.proposer is None or len(self.scheduler.running) > self.speculative.max_batch_size))

    # -- speculative decoding ------------------------------------------------------------------------------------
    def _make_proposer(self, config: EngineConfig):
        spec = config.speculative
        if not spec.enabled:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        from serval.engine.draft_proposer import DraftProposer

        layers = spec.early_exit_layers
        if layers is not None:
            if layers >= self.model.config.num_layers:
                raise ValueError(f"--speculative-model self-layers:{layers}: the model has only "
                                 f"{self.model.config.num_layers} layers")
            return DraftProposer(self.runner, self.model, layers)
        if spec.method == "self-int4":  # the target's own file, read in its 4-bit blocks by the CPU kernel
            if not has_4bit_blocks(Path(self.info.model_path)):
                raise ValueError("--speculative-model self-int4 needs a GGUF file with Q4_0 or Q4_1 matrices; "
                                 f"{Path(self.info.model_path).name} has none")
            draft_model = load_model(Path(self.info.model_path), config.torch_dtype, config.device, "gguf")
        else:
            draft_model = load_model(resolve_model_path(spec.draft_model), config.torch_dtype, config.device,
                                     config.quantization)
        use_activation_quantization(draft_model, config.activation_quantization)
        use_dot_products(draft_model, config.block_dot_products)
        use_cpu_layers(draft_model, not config.enforce_eager)
        self.runner.draft = proposer = DraftProposer(self.runner, draft_model)
        return proposer

    def _propose(self) -> None:
        """Guesses the next tokens of every running request past its prompt, while the batch is small enough for
        guesses to pay (SpeculativeConfig.max_batch_size)."""
        running = self.scheduler.running
        if len(running) > self.speculative.max_batch_size:
            return
        requests, rooms = [], []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1 or request.max_tokens == 0:
                continue  # still computing its prompt (or recomputing after a preemption)
            room = min(self.speculative.num_speculative_tokens,
                       request.max_tokens - len(request.output_token_ids) - 1,  # the step adds one more token
                       self.max_model_len - request.num_tokens)  # every guess takes a KV slot
            # A draft model writes the guessed positions' KV: their slots (the next step's anyway) come first.
            if room > 0 and (not self.proposer.needs_slots or self.kv_cache.allocate_slots(request, 1 + room)):
                requests.append(request)
                rooms.append(room)
        if not requests:
            return
        self._transfer()  # the slots' allocation may have evicted blocks to save before a draft writes them
        for request, guesses in zip(requests, self.proposer.propose_requests(requests, rooms)):
            if guesses and request.request_id in self.structured_ids:
                guesses = self.structured.valid_prefix(request.request_id, guesses)
            request.spec_token_ids = guesses

    # -- structured outputs --------------------------------------------------------------------------------------
    @property
    def structured_ids(self):
        """The ids of the requests under a grammar (supports ``in`` and ``len``)."""
        return self.structured if self.structured is not None else ()

    def _take_compiled_grammars(self) -> None:
        """Schedules the requests whose grammar has compiled; fails those whose grammar did not."""
        ready, failed = self.structured.take_compiled()
        for request_id in ready:
            self._schedule(self._grammar_waiting.pop(request_id))
        for request_id, error in failed.items():
            del self._grammar_waiting[request_id]
            self._pending.append(EngineCoreOutput(request_id, [], finish_reason="error", error=error))

    def _grammar_bitmasks(self, scheduled) -> tuple[dict, dict[str, str]]:
        """Bitmasks for the constrained requests that sample this step (their prompt is computed by its end), and
        the errors of those whose matcher failed."""
        if not self.structured_ids:
            return {}, {}
        wanted = {}
        for request in scheduled.scheduled:
            if request.request_id not in self.structured_ids or request.max_tokens == 0:
                continue
            guesses = scheduled.spec_token_ids.get(request.request_id, [])
            end = request.num_computed_tokens + scheduled.num_scheduled_tokens[request.request_id] - len(guesses)
            if end == request.num_tokens:
                wanted[request.request_id] = guesses
        return self.structured.bitmasks(wanted) if wanted else ({}, {})

    def _advance_grammar(self, request: Request, new_tokens: list[int]) -> str | None:
        """Feeds the kept tokens to the request's matcher; a finished grammar ends the request (even one that
        ignores eos), and a refused token (only when every token was masked) fails it: returns its error."""
        if not self.structured.accept(request.request_id, new_tokens):
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            return "the grammar allowed no token at this position (are logit_bias or min_tokens excluding them?)"
        if self.structured.is_terminated(request.request_id) and not request.status.finished:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return None

    def _count_accepted(self, scheduled, sampled: dict[str, list[int]]) -> None:
        stats = self.stats
        for request_id, guesses in scheduled.spec_token_ids.items():
            kept = sampled.get(request_id)
            if kept is None:
                continue  # failed or aborted while the step ran
            accepted = len(kept) - 1
            stats.spec_num_drafts += 1
            stats.spec_num_draft_tokens += len(guesses)
            stats.spec_num_accepted_tokens += accepted
            for position in range(accepted):
                stats.spec_accepted_per_position[position] += 1

    def _release(self, request: Request) -> None:
        if request.transfer_id is not None:  # a prefill that ends without its blocks held (aborted, failed)
            self.kv_transfer.fail(request.transfer_id, f"the request ended ({request.status.value})")
            request.transfer_id = None
        self._requests.pop(request.request_id, None)
        if request.request_id in self.structured_ids:
            self.structured.remove(request.request_id)
        self._unreported.discard(request.request_id)
        self.stats.num_finished_requests += 1

    def snapshot(self) -> EngineCoreStats:
        s, kv, scheduler = self.stats, self.kv_cache, self.scheduler
        s.num_running, s.num_waiting = len(scheduler.running), len(scheduler.waiting) + len(self._grammar_waiting)
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
        if self.kv_transfer is not None:
            t = self.kv_transfer.stats
            s.kv_held_blocks, s.kv_sent_blocks, s.kv_sent_bytes = t.held_blocks, t.sent_blocks, t.sent_bytes
            s.kv_received_blocks, s.kv_received_bytes = t.received_blocks, t.received_bytes
            s.kv_expired_holds, s.kv_failed_fetches = t.expired_holds, t.failed_fetches
            s.kv_fetches, s.kv_fetch_seconds = t.fetches, t.fetch_seconds
            s.kv_sent_early_blocks = t.sent_early_blocks
        return EngineCoreStats(**{**s.__dict__, "spec_accepted_per_position": list(s.spec_accepted_per_position)})
