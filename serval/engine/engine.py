"""LLMEngine: the synchronous step loop (schedule → run → update → detokenize)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from serval.config import EngineConfig
from serval.engine.kv_cache import KVCacheManager
from serval.engine.request import Request, RequestStatus
from serval.engine.runner import ModelRunner, kv_cache_block_bytes
from serval.engine.scheduler import Scheduler
from serval.layers.sampler import TokenLogprobs
from serval.model.loader import load_model
from serval.model.registry import resolve_model_path
from serval.outputs import CompletionOutput, RequestOutput
from serval.sampling_params import SamplingParams
from serval.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """Output-side state of one sample (one scheduler request)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(eq=False)
class _Group:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # grows chunk by chunk; the first entry is None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class EngineStats:
    """Counters since start: what the engine computed."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model (prompt chunks, recompute, decodes)
    num_generated_tokens: int = 0
    num_finished_requests: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer: Tokenizer | None = None) -> None:
        """Loads the model named by ``config`` (or reuses an already loaded ``model`` and ``tokenizer`` of the
        same dtype and device, e.g. to try several cache or scheduler settings on one set of weights)."""
        self.config = config = config or EngineConfig()
        start = time.perf_counter()
        path = resolve_model_path(config.model)
        self.model_path = path
        self.tokenizer = tokenizer or Tokenizer.load(path)
        self.model = model or load_model(path, config.torch_dtype, config.device, config.quantization)
        self.stats = EngineStats()
        model_config = self.model.config
        cache = config.cache
        num_blocks = cache.num_blocks or int(
            cache.kv_cache_memory * 2**30 // kv_cache_block_bytes(model_config, cache.block_size, config.torch_dtype))
        if num_blocks < 2:
            raise ValueError(f"CacheConfig.kv_cache_memory={cache.kv_cache_memory} GiB holds fewer than 2 blocks")
        # A request alone must always fit, or preemption could never make room for it.
        self.max_model_len = min(config.max_model_len or model_config.max_position, num_blocks * cache.block_size)
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.runner = ModelRunner(self.model, num_blocks, cache.block_size, config.torch_dtype, config.device)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, tuple[_Group, _Sample]] = {}
        self._finished_outputs: list[RequestOutput] = []
        self.load_time = time.perf_counter() - start
        logger.info("engine ready in %.1f s: %d KV blocks of %d tokens, context %d", self.load_time, num_blocks,
                    cache.block_size, self.max_model_len)

    # -- requests in -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queues a request. ``prompt`` is text (tokenized here) or token ids. Raises ValueError on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._prompt_token_ids(prompt)
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        group = _Group(request_id, prompt_text, prompt_ids, params, [],
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child_params = params
            if params.n > 1 and (params.seed is not None or params.prompt_logprobs is not None):
                changes: dict = {"n": 1}
                if params.seed is not None:  # distinct but reproducible samples
                    changes["seed"] = params.seed + index
                if index > 0:  # the first sample scores the prompt; the others share its cached blocks
                    changes["prompt_logprobs"] = None
                child_params = SamplingParams(**{**params.__dict__, **changes})
            request = Request(child_id, prompt_ids, child_params, self.eos_token_ids, max_tokens, priority,
                              group_id=request_id if params.n > 1 else None)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            sample = _Sample(request, detok, logprobs=[] if params.logprobs is not None else None)
            group.samples.append(sample)
        self.groups[request_id] = group
        for sample in group.samples:
            self.samples[sample.request.request_id] = (group, sample)
            self.scheduler.add_request(sample.request)

    def abort_request(self, request_id: str) -> None:
        """Stops a request now and frees its blocks; its final output (finish_reason "abort") comes from the next
        step(). Unknown or finished ids are ignored."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for sample in group.samples:
            if sample.finish_reason is None:
                self.scheduler.finish_request(sample.request, RequestStatus.FINISHED_ABORTED)
                sample.finish_reason = "abort"
        self._finished_outputs.append(self._finish_group(group))

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._finished_outputs)

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for every request that advanced or finished."""
        outputs, self._finished_outputs = self._finished_outputs, []
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduled = self.scheduler.schedule()
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += scheduled.total_num_scheduled_tokens
        step_start = time.monotonic()
        for request in scheduled.scheduled:
            group = self.samples[request.request_id][0]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = step_start
        try:
            result = self.runner.execute(scheduled)
        except Exception as exc:  # a failed forward fails its batch, never the engine
            logger.exception("step failed; failing its %d requests", len(scheduled.scheduled))
            for request in scheduled.scheduled:
                self._fail(request, f"internal error: {exc}")
            return outputs + self._collect({self.samples[r.request_id][0] for r in scheduled.scheduled
                                            if r.request_id in self.samples})
        for request_id, (first, entries) in result.prompt_logprobs.items():
            group = self.samples[request_id][0]
            del group.prompt_logprobs[first:]  # a chunk computed again after a preemption replaces its entries
            group.prompt_logprobs.extend(entries)
        touched = set()
        for request in self.scheduler.update_from_output(scheduled, result.sampled_token_ids):
            group, sample = self.samples[request.request_id]
            try:
                self._process_token(group, sample, result.logprobs.get(request.request_id))
            except Exception as exc:  # e.g. a detokenizer failure: only this request pays
                logger.exception("request %s failed", request.request_id)
                self._fail(request, f"output processing failed: {exc}")
            touched.add(group)
        self.stats.num_generated_tokens += len(result.sampled_token_ids)
        return outputs + self._collect(touched)

    def _process_token(self, group: _Group, sample: _Sample, token_logprobs: TokenLogprobs | None) -> None:
        request = sample.request
        if not request.output_token_ids:  # max_tokens 0: the prompt was computed, and that was all
            sample.finish_reason = request.status.value
            return
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        previous_len = len(sample.text)
        sample.text += sample.detokenizer.add(request.output_token_ids[-1])
        if sample.logprobs is not None and token_logprobs is not None:
            sample.logprobs.append(token_logprobs)
        stops = request.sampling_params.stop
        if stops and not request.status.finished:
            window_start = max(0, previous_len - max(map(len, stops)) + 1)
            for stop in stops:
                at = sample.text.find(stop, window_start)
                if at != -1:
                    keep = at + len(stop) if request.sampling_params.include_stop_str_in_output else at
                    sample.text = sample.text[:keep]
                    request.stop_reason = stop
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
                    break
        if request.status.finished:
            if request.status != RequestStatus.FINISHED_STOPPED or request.stop_reason not in stops:
                sample.text += sample.detokenizer.flush()  # bytes of a character the output cut in half
            sample.finish_reason = request.status.value
            sample.stop_reason = request.stop_reason

    def _fail(self, request: Request, message: str) -> None:
        group, sample = self.samples[request.request_id]
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        sample.finish_reason = "error"
        group.error = message

    def _collect(self, groups) -> list[RequestOutput]:
        outputs = []
        for group in groups:
            if group.finished:
                outputs.append(self._finish_group(group))
            else:
                outputs.append(self._output(group))
        return outputs

    def _finish_group(self, group: _Group) -> RequestOutput:
        self.stats.num_finished_requests += 1
        for sample in group.samples:
            self.samples.pop(sample.request.request_id, None)
            self.runner.release(sample.request.request_id)
        self.groups.pop(group.request_id, None)
        return self._output(group)

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for index, sample in enumerate(group.samples):
            text = sample.text
            stops = sample.request.sampling_params.stop
            if sample.finish_reason is None and stops:  # hold back a possible stop string's beginning
                text = text[: max(0, len(text) - max(map(len, stops)) + 1)]
            completions.append(CompletionOutput(index, text, list(sample.request.output_token_ids),
                                                sample.finish_reason, sample.stop_reason,
                                                list(sample.logprobs) if sample.logprobs is not None else None))
        now = time.monotonic()
        metrics = {"arrival_time": group.arrival_time, "now": now}
        if group.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = group.first_scheduled_time
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        cached = max(0, group.samples[0].request.num_cached_tokens)
        prompt_logprobs = list(group.prompt_logprobs) if group.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, cached,
                             group.finished, group.error, metrics, prompt_logprobs)

    # -- validation --------------------------------------------------------------------------------------------
    def _prompt_token_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise ValueError(f"prompt token id {token!r} is not in the vocabulary [0, {vocab})")
        return None, list(prompt)

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        scheduler = self.config.scheduler
        if not scheduler.enable_chunked_prefill and num_prompt_tokens > scheduler.max_num_batched_tokens:
            raise ValueError(f"prompt is {num_prompt_tokens} tokens, more than max_num_batched_tokens="
                             f"{scheduler.max_num_batched_tokens}, and chunked prefill is off")
        # A prompt may fill the whole context only when nothing is generated after it (max_tokens 0).
        if num_prompt_tokens > limit or (num_prompt_tokens == limit and params.max_tokens != 0):
            raise ValueError(f"prompt is {num_prompt_tokens} tokens; this model's context is {limit} tokens")
        if params.max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + params.max_tokens > limit:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens is more "
                             f"than this model's context of {limit} tokens")
        return params.max_tokens
