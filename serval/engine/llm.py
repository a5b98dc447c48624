"""LLM: the offline API (generate, chat) on top of LLMEngine."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from serval.chat import build_chat_prompt
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.engine import LLMEngine
from serval.outputs import RequestOutput
from serval.sampling_params import SamplingParams, prompt_room

Prompt = str | list[int]
logger = logging.getLogger(__name__)


class LLM:
    """Loads a model and runs batches of prompts to completion.

    >>> LLM().generate(["The capital city of Korea is"], SamplingParams(temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = EngineConfig.device,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_chunked_prefill: bool = True,
                 kv_cache_memory: float | None = None, num_blocks: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 context_policy: str = "error", quantization: str = "auto", speculative_model: str | None = "ngram",
                 num_speculative_tokens: int = 4, speculative_max_batch_size: int | None = None,
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 activation_quantization: str = EngineConfig.activation_quantization,
                 block_dot_products: str = EngineConfig.block_dot_products) -> None:
        """None and "auto" take the device's defaults (config.py: EngineConfig, DeviceDefaults)."""
        config = EngineConfig(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len, context_policy=context_policy,
            quantization=quantization, activation_quantization=activation_quantization,
            block_dot_products=block_dot_products,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, num_blocks=num_blocks,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      enable_chunked_prefill=enable_chunked_prefill),
            speculative=SpeculativeConfig(method=speculative_model, num_speculative_tokens=num_speculative_tokens,
                                          max_batch_size=speculative_max_batch_size),
        )
        self._attach(LLMEngine(config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wraps an existing engine (its loaded weights and settings)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Completes raw prompts (text or token ids); outputs come back in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, priority)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Answers conversations through the model's chat template (one list of messages, or several)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params_list = self._params_list(sampling_params, len(conversations))
        prompts = []
        for conversation, params in zip(conversations, params_list):
            room = prompt_room(self.engine.max_model_len, params.max_tokens)
            prompt = build_chat_prompt(self.tokenizer, conversation, room, self.engine.config.context_policy)
            if prompt.num_dropped_messages:
                logger.warning("context window: dropped the %d oldest messages of a chat",
                               prompt.num_dropped_messages)
            prompts.append(prompt.token_ids)
        return self._run(prompts, params_list, use_tqdm, None)

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm: bool,
             priority: Sequence[int] | None) -> list[RequestOutput]:
        params_list = self._params_list(sampling_params, len(prompts))
        # Validate everything before queueing anything, so one bad prompt leaves no half-queued batch.
        ids = [str(next(self._ids)) for _ in prompts]
        added = []
        try:
            for i, (request_id, prompt, params) in enumerate(zip(ids, prompts, params_list)):
                self.engine.add_request(request_id, prompt, params, priority[i] if priority else 0)
                added.append(request_id)
        except ValueError as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
            self.engine.step()  # drain the abort outputs
            raise ValueError(f"prompt {len(added)}: {exc}") from exc
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generating", unit="req", dynamic_ncols=True)
        while len(results) < len(prompts):
            for output in self.engine.step():
                if output.finished and output.request_id in ids:
                    results[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params gets: the model's sampling defaults (EngineConfig.generation_config),
        else SamplingParams' own, as vLLM's LLM does."""
        return SamplingParams(**self.engine.sampling_defaults.values)

    def _params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(f"got {len(params_list)} SamplingParams for {count} prompts")
        return params_list
