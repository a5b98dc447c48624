"""On a GPU the KV cache takes --gpu-memory-utilization of the memory a profiling forward pass leaves free, and the
scheduler the GPU's limits. Skipped without a CUDA device; the arithmetic is tested on CPU in test_memory_profile.py."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from real_model import MODEL_PATH, requires_model

from serval.config import CacheConfig, EngineConfig
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.engine.runner import kv_cache_block_bytes
from serval.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, requires_model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GIB = 2**30


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_the_kv_cache_is_sized_from_the_free_gpu_memory():
    _release()
    free_at_start, total = torch.cuda.mem_get_info()
    core = EngineCore(EngineConfig(device="auto"), MODEL_PATH)  # every default: what `serval serve` gets on a GPU
    model = core.model
    try:
        config = core.config
        assert config.device == "cuda" and core.runner.kv_cache.device.type == "cuda"
        assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (8192, 256)
        weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        block_bytes = kv_cache_block_bytes(model.config, config.cache.block_size, config.kv_cache_torch_dtype)
        kv_bytes = core.info.num_blocks * block_bytes
        print(f"\nGPU {torch.cuda.get_device_name()}: total {total / GIB:.2f} GiB, free at start "
              f"{free_at_start / GIB:.2f}, weights {weights / GIB:.3f}, KV cache {kv_bytes / GIB:.2f} GiB "
              f"({core.info.num_blocks} blocks of {block_bytes} bytes, {config.dtype}): "
              f"{kv_bytes / (total - weights):.3f} of total less weights, "
              f"{kv_bytes / (free_at_start - weights):.3f} of free less weights; max_model_len {core.max_model_len}")
        # Of the memory free before the engine (other tests' engines may still hold some): 0.9 of what the
        # weights, the profile's activations and the CUDA context leave.
        assert 0.5 <= kv_bytes / (free_at_start - weights) <= 0.95
        # The cache works: a greedy request runs to its end and frees its blocks.
        params = SamplingParams(temperature=0, max_tokens=8)
        core.add_request(EngineCoreRequest("r", list(range(100, 140)), params, [], 8))
        tokens = []
        while core.has_unfinished_requests():
            tokens += [t for out in core.step().outputs for t in out.new_token_ids]
        assert len(tokens) == 8 and core.kv_cache.pool.num_owned_blocks() == 0
        blocks_at_0_9 = core.info.num_blocks
    finally:
        core.shutdown()
        del core
        _release()
    # Half the utilization, half the blocks (the weights, reused, and the profile's peak are the same).
    half = EngineCore(EngineConfig(device="cuda", cache=CacheConfig(gpu_memory_utilization=0.45)), MODEL_PATH,
                      model=model)
    try:
        ratio = half.info.num_blocks / blocks_at_0_9
        print(f"--gpu-memory-utilization 0.45: {half.info.num_blocks} blocks, {ratio:.3f} of 0.9's")
        assert 0.45 <= ratio <= 0.55
    finally:
        half.shutdown()
        del half
        _release()
