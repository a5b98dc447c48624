"""The KV cache's size: given in blocks or GiB, else (on a GPU) ``--gpu-memory-utilization`` of the memory a profiling
forward of the largest step leaves free. The arithmetic and the profile's steps run here on the CPU; the sizing on a
real GPU is tests/engine/test_cuda_memory.py."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, SchedulerConfig
from serval.engine.memory_profile import _dummy_step, kv_cache_num_blocks, num_kv_blocks, profile_forward
from serval.engine.runner import kv_cache_block_bytes

GIB, MIB = 2**30, 2**20


def test_the_kv_cache_takes_the_share_of_the_free_memory():
    # 80 GiB, 10 in use at the profile's peak: 0.9 of the 70 left, in blocks of 1 MiB.
    assert kv_cache_num_blocks(80 * GIB, 10 * GIB, 0.9, MIB) == int(0.9 * 70 * GIB) // MIB == 64512
    assert kv_cache_num_blocks(80 * GIB, 10 * GIB, 1.0, MIB) == 70 * 1024
    assert kv_cache_num_blocks(80 * GIB, 10 * GIB, 0.5, 3 * MIB) == 35 * 1024 // 3  # whole blocks only
    assert kv_cache_num_blocks(16 * GIB, 16 * GIB - 2 * MIB, 1.0, MIB) == 2  # the least the engine runs with


@pytest.mark.parametrize("total, in_use, utilization", [
    (16 * GIB, 16 * GIB, 0.9),  # nothing left
    (16 * GIB, 17 * GIB, 0.9),  # more in use than the device has (other processes grew meanwhile)
    (16 * GIB, 16 * GIB - 2 * MIB, 0.9),  # room for 1.8 blocks
])
def test_too_little_free_memory_is_an_error_naming_the_flag(total, in_use, utilization):
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.9 .* holds [01] KV blocks .* --kv-cache-memory"):
        kv_cache_num_blocks(total, in_use, utilization, MIB)


def test_on_the_cpu_the_kv_cache_is_the_given_size_or_1_gib(smollm):
    model, _ = smollm("float32")
    block_bytes = kv_cache_block_bytes(model.config, 16, torch.float32)
    assert num_kv_blocks(EngineConfig(dtype="float32"), model) == GIB // block_bytes
    assert num_kv_blocks(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory=0.25)), model) == \
        GIB // 4 // block_bytes
    assert num_kv_blocks(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=7, kv_cache_memory=4)), model) == 7
    with pytest.raises(ValueError, match="kv_cache_memory=1e-06 GiB holds fewer than 2 blocks"):
        num_kv_blocks(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory=1e-6)), model)


def test_the_profiles_steps_are_the_whole_budget_in_one_chunk_and_over_max_num_seqs():
    one = _dummy_step([100], 16, 50)
    assert one.total_num_scheduled_tokens == 100 and one.scheduled[0].block_ids == list(range(7))
    many = _dummy_step([3, 3, 2], 2, 50)
    assert [r.block_ids for r in many.scheduled] == [[0, 1], [2, 3], [4]]  # each its own blocks, none shared
    assert all(r.max_tokens == 1 and r.num_prompt_tokens == many.num_scheduled_tokens[r.request_id]
               for r in many.scheduled)


def test_the_profiling_forward_runs_through_the_runner_on_the_cpu(smollm):
    model, _ = smollm("float32")
    config = EngineConfig(dtype="float32",
                          scheduler=SchedulerConfig(max_num_batched_tokens=70, max_num_seqs=8)).settled()
    # The chunk of 70 tokens needs 5 blocks of 16; 8 sequences of 8 or 9 tokens need 8: the larger is allocated.
    assert profile_forward(config, model) == 8 * kv_cache_block_bytes(model.config, 16, torch.float32)
    capped = EngineConfig(dtype="float32", max_model_len=40,
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=1)).settled()
    assert profile_forward(capped, model) == 3 * kv_cache_block_bytes(model.config, 16, torch.float32)


def test_the_profile_counts_the_peak_less_its_temporary_cache_and_what_torch_does_not_hold(smollm, monkeypatch):
    """The accounting of profile_cuda_memory, with the GPU's counters faked and the forward run on the CPU: the peak
    of this process's tensors, less the profile's own temporary cache, plus everything else the driver counts as
    used once torch emptied its cache (the CUDA context, other processes, reserved blocks torch cannot hand back)."""
    from serval.engine import memory_profile

    model, _ = smollm("float32")
    calls = []
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 10 * GIB)
    tensors_now = {"bytes": 8 * GIB}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: tensors_now["bytes"])

    def mem_get_info(device):
        calls.append("mem_get_info")
        return 60 * GIB, 80 * GIB  # 20 GiB used: 8 of tensors, 12 of context, other processes, held reserve

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    config = EngineConfig(dtype="float32",
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)).settled()
    temporary = profile_forward(config, model)
    total, in_use = memory_profile.profile_cuda_memory(config, model)
    assert (total, in_use) == (80 * GIB, 12 * GIB + 10 * GIB - temporary)
    # The peak is the profile's own (reset after the caches of dropped engines are freed); the driver is asked
    # only after torch handed back its free blocks.
    assert calls == ["empty_cache", "synchronize", "reset_peak_memory_stats", "synchronize", "empty_cache",
                     "mem_get_info"]
    # Blocks torch holds reserved and cannot hand back (a dropped engine's cache, seen on an H200) are not free.
    tensors_now["bytes"] = 1 * GIB
    assert memory_profile.profile_cuda_memory(config, model) == (80 * GIB, 19 * GIB + 10 * GIB - temporary)
    # With kv_cache_memory None (a GPU's default), the blocks are 0.9 of what is left.
    tensors_now["bytes"] = 8 * GIB
    config.cache.kv_cache_memory = None
    block_bytes = kv_cache_block_bytes(model.config, 16, torch.float32)
    assert num_kv_blocks(config, model) == kv_cache_num_blocks(80 * GIB, 22 * GIB - temporary, 0.9, block_bytes)


def test_a_profile_that_runs_out_of_gpu_memory_names_the_step_limits(smollm, monkeypatch):
    from serval.engine import memory_profile

    def out_of_memory(config, model):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.50 GiB")

    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(memory_profile, "profile_forward", out_of_memory)
    config = EngineConfig(dtype="float32",
                          scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256)).settled()
    with pytest.raises(ValueError, match=r"\(8192 tokens, 256 sequences\) ran out of GPU memory: lower "
                                         "--max-num-batched-tokens or --max-num-seqs"):
        memory_profile.profile_cuda_memory(config, smollm("float32")[0])
