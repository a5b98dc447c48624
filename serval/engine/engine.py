"""LLMEngine: a front end and an EngineCore in one thread (offline use, tests, the in-process server engine).

step() = core.step() (schedule → run → update, on token ids) → the front end's detokenizing and stop strings.
With SchedulerConfig.async_output_processing (CUDA's default) the front end works on step N's core outputs while the
device computes step N+1, so step() returns them one step later.
"""

from __future__ import annotations

import logging
import time

from serval.config import EngineConfig
from serval.engine.core import EngineCore
from serval.engine.frontend import FrontEnd
from serval.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineCoreStats
from serval.engine.request import RequestStatus
from serval.outputs import RequestOutput
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class InprocCore:
    """LLMEngine's core client (frontend.CoreClient): the EngineCore in this thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def pack(self, core_requests: list[EngineCoreRequest]) -> list[EngineCoreRequest]:
        """A grammar is checked here, in the caller's thread: refused at once, not at its compile in the core."""
        grammar = core_requests[0].params.structured_outputs
        if grammar is not None:
            from serval.engine.structured_output import check_grammar_syntax

            check_grammar_syntax(grammar)
        return core_requests

    def send(self, core_requests: list[EngineCoreRequest]) -> None:
        for core_request in core_requests:
            self.core.add_request(core_request)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer: Tokenizer | None = None) -> None:
        """Loads the model named by ``config`` (or reuses an already loaded ``model`` and ``tokenizer`` of the
        same dtype and device, e.g. to try several cache or scheduler settings on one set of weights)."""
        config = config or EngineConfig()
        start = time.perf_counter()
        self.front = FrontEnd(config, tokenizer)
        self.model_path = self.front.model_path
        self.core = EngineCore(config, self.model_path, model)
        self._core_client = InprocCore(self.core)
        self.config = config = self.core.config  # settled: its device, dtype and their defaults decided
        info = self.core.info
        self.front.connect(info)
        self.max_model_len = info.max_model_len
        # The front end's parts, by the names the callers know.
        self.tokenizer, self.sampling_defaults = self.front.tokenizer, self.front.sampling_defaults
        self.inputs, self.outputs = self.front.inputs, self.front.outputs
        self._finished_outputs: list[RequestOutput] = []
        self._async_output_processing = config.scheduler.async_output_processing
        self._unprocessed: list[EngineCoreOutput] = []  # the last step's core outputs, with async output processing
        self.load_time = time.perf_counter() - start
        logger.info("engine ready in %.1f s: %d KV blocks of %d tokens, context %d", self.load_time,
                    info.num_blocks, config.cache.block_size, self.max_model_len)

    # The core's parts, for tests and tools that look inside (the server never does).
    @property
    def model(self):
        return self.core.model

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache(self):
        return self.core.kv_cache

    @property
    def runner(self):
        return self.core.runner

    @property
    def stats(self) -> EngineCoreStats:
        return self.core.stats

    # -- requests in -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, session_id: str | None = None, end_session: bool = False,
                    tenant: str = "") -> None:
        """Queues a request. ``prompt`` is text (tokenized here) or token ids. Raises ValueError on bad input.
        ``session_id``: a conversation whose KV is kept for its next turn when this request ends (unless
        ``end_session``: its last turn)."""
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prepared = self.front.prepare(self._core_client, request_id, prompt, params, priority, session_id,
                                      end_session, tenant)
        self.front.register(prepared)
        self._core_client.send(prepared.packed)

    def kv_state(self) -> dict:
        return self.core.kv_state()

    def end_session(self, session_id: str) -> bool:
        """Lets a conversation's kept KV go now. False: the engine held no such session."""
        return self.core.end_session(session_id)

    def shutdown(self) -> None:
        """Lets the engine's files go (a disk KV tier keeps the prefix cache for the next run)."""
        self.core.shutdown()

    def abort_request(self, request_id: str) -> None:
        """Stops a request now and frees its blocks; its final output (finish_reason "abort") comes from the next
        step(). Unknown or finished ids are ignored."""
        output, running = self.outputs.abort(request_id)
        if output is None:
            return
        self.core.finish_requests(running)
        self._finished_outputs.append(output)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or bool(self._finished_outputs) or bool(self._unprocessed)

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for every request that advanced or finished (with async output
        processing: in the step before this one)."""
        outputs, self._finished_outputs = self._finished_outputs, []
        if self._async_output_processing:
            return outputs + self._step_processing_the_last_outputs()
        if not self.core.has_unfinished_requests():
            return outputs
        core_outputs = self.core.step()
        processed, stopped = self.outputs.process(core_outputs.outputs)
        self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs + processed

    def _step_processing_the_last_outputs(self) -> list[RequestOutput]:
        """A core step during whose forward the front end processes the previous step's core outputs. A request a
        stop string ends there is already in this step's batch: the core finishes it after the step, and the front
        end, which has finished it, drops the token it got."""
        last, self._unprocessed = self._unprocessed, []
        processed: list[RequestOutput] = []
        stopped: list[str] = []

        def process_last() -> None:
            if last:
                outputs, stops = self.outputs.process(last)
                processed.extend(outputs)
                stopped.extend(stops)
                last.clear()

        if self.core.has_unfinished_requests():
            self._unprocessed = self.core.step(while_device_runs=process_last).outputs
        process_last()  # a step that sampled nothing, or none ran
        self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return processed
