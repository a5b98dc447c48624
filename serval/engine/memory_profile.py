"""How many KV cache blocks the engine allocates: a size given in GiB (or blocks), else, on a GPU, what a profiling
forward pass leaves free.

On CUDA the KV cache takes ``--gpu-memory-utilization`` of the memory still free once the weights are loaded and one
forward of the largest step the scheduler can make has run (its activations and logits at their peak), as vLLM sizes
it. The share is of the free memory rather than of the whole GPU, so that engines sharing a GPU (several cores in one
test process, or another process) each get room instead of an error; alone on a GPU the two differ by
(1 - utilization) of what the weights and activations take. The arithmetic is ``kv_cache_num_blocks``, a pure
function."""

from __future__ import annotations

import gc
import logging

import torch

from serval.config import CPU_KV_CACHE_GIB, EngineConfig
from serval.engine.request import Request
from serval.engine.runner import ModelRunner, kv_cache_block_bytes
from serval.engine.scheduler import SchedulerOutput
from serval.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
GIB = 2**30


def kv_cache_num_blocks(total_bytes: int, in_use_bytes: int, utilization: float, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` that fit in ``utilization`` of the device memory left free (``total_bytes`` less
    ``in_use_bytes``, everything held at the profile's peak). Fewer than 2 is a ValueError: the engine cannot run."""
    free_bytes = max(total_bytes - in_use_bytes, 0)
    num_blocks = int(utilization * free_bytes) // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} of the {free_bytes / GIB:.2f} GiB of GPU memory left free after "
            f"the profiling forward pass holds {num_blocks} KV blocks of {block_bytes} bytes (the engine needs at "
            "least 2): raise --gpu-memory-utilization, free GPU memory, or give --kv-cache-memory")
    return num_blocks


def num_kv_blocks(config: EngineConfig, model: torch.nn.Module) -> int:
    """The KV cache's blocks for ``model``: ``cache.num_blocks``, else ``cache.kv_cache_memory`` GiB, else (None on
    CUDA) profiled. Under model parallelism the ranks would have to join the profile's forward: the CPU's size then."""
    cache = config.cache
    if cache.num_blocks:
        return cache.num_blocks
    block_bytes = kv_cache_block_bytes(model.config, cache.block_size, config.kv_cache_torch_dtype)
    memory = cache.kv_cache_memory
    if memory is None and config.world_size > 1:
        memory = CPU_KV_CACHE_GIB
        logger.warning("KV cache: %g GiB (no profiling under model parallelism: give --kv-cache-memory)", memory)
    if memory is not None:
        num_blocks = int(memory * GIB // block_bytes)
        if num_blocks < 2:
            raise ValueError(f"CacheConfig.kv_cache_memory={memory} GiB holds fewer than 2 blocks")
        return num_blocks
    total_bytes, in_use_bytes = profile_cuda_memory(config, model)
    num_blocks = kv_cache_num_blocks(total_bytes, in_use_bytes, cache.gpu_memory_utilization, block_bytes)
    logger.info("KV cache: %d blocks, %.2f GiB: %.2f of the %.2f GiB left free (of %.2f) after a profiling forward",
                num_blocks, num_blocks * block_bytes / GIB, cache.gpu_memory_utilization,
                (total_bytes - in_use_bytes) / GIB, total_bytes / GIB)
    return num_blocks


def profile_cuda_memory(config: EngineConfig, model: torch.nn.Module) -> tuple[int, int]:
    """(total, in use) bytes of the engine's GPU at the peak of a profiling forward: this process's tensors at their
    peak (the profile's temporary KV cache left out) and everything else the driver counts as used (the CUDA
    context, other processes, and what torch holds reserved after emptying its cache)."""
    device = torch.device(config.device)
    gc.collect()  # engines already dropped free their caches now, not at some later collection
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        temporary_cache_bytes = profile_forward(config, model)
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(
            f"the profiling forward of the largest step ({config.scheduler.max_num_batched_tokens} tokens, "
            f"{config.scheduler.max_num_seqs} sequences) ran out of GPU memory: lower --max-num-batched-tokens or "
            "--max-num-seqs, or free GPU memory") from exc
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    # What the driver counts as used once torch has handed back what it can, with this process's tensors at their
    # profile peak instead of their size now. Memory torch keeps reserved and cannot hand back (a dropped engine's
    # blocks still in a pool) counts as used: a new cache could not get it from cudaMalloc, and sizing the cache
    # as if it could ran a second engine in one process out of memory on an H200 (test_cuda.py).
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    tensors_now = torch.cuda.memory_allocated(device)
    return total_bytes, total_bytes - free_bytes - tensors_now + peak - temporary_cache_bytes


def profile_forward(config: EngineConfig, model: torch.nn.Module) -> int:
    """Runs the largest steps the scheduler can make through a ModelRunner with a temporary KV cache just big enough,
    then drops it: one prompt chunk of the whole token budget (attention's peak), and the budget split over
    max_num_seqs sequences that all sample (the logits' peak). Returns the temporary cache's bytes."""
    scheduler, block_size = config.scheduler, config.cache.block_size
    budget = min(scheduler.max_num_batched_tokens, config.max_model_len or model.config.max_position)
    num_seqs = min(scheduler.max_num_seqs, budget)
    steps = [[budget], [budget // num_seqs + (i < budget % num_seqs) for i in range(num_seqs)]]
    num_blocks = max(sum(-(-length // block_size) for length in lengths) for lengths in steps)
    runner = ModelRunner(model, num_blocks, block_size, config.kv_cache_torch_dtype, config.device)
    for lengths in steps:
        runner.execute(_dummy_step(lengths, block_size, model.config.vocab_size))
    del runner
    gc.collect()
    return num_blocks * kv_cache_block_bytes(model.config, block_size, config.kv_cache_torch_dtype)


def _dummy_step(lengths: list[int], block_size: int, vocab_size: int) -> SchedulerOutput:
    """A step of whole prompts of these lengths, each in its own run of blocks, each sampling one token."""
    out, next_block = SchedulerOutput(), 0
    for i, length in enumerate(lengths):
        request = Request(f"profile-{i}", [(i + j) % vocab_size for j in range(length)],
                          SamplingParams(temperature=0, max_tokens=1), max_tokens=1)
        num_blocks = -(-length // block_size)
        request.block_ids = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        out.scheduled.append(request)
        out.num_scheduled_tokens[request.request_id] = length
    return out
