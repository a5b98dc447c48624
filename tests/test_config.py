"""EngineConfig: ``dtype="auto"`` resolves to what the hardware computes fast, ``device="auto"`` to a GPU when there is
one, and the fields left unset to the device's defaults; bad values name their field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serval.config import (
    CPU_KV_CACHE_GIB,
    CPU_MAX_NUM_SEQS,
    CPU_SPECULATIVE_MAX_BATCH_SIZE,
    CUDA_SPECULATIVE_MAX_BATCH_SIZE,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    auto_dtype,
    default_token_budget,
)
from serval.platform_info import cpu_capability


def test_auto_dtype_follows_native_bf16_support():
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert auto_dtype("cpu") == ("bfloat16" if native_bf16 else "float32")
    config = EngineConfig().settled()  # the default is auto, resolved when the config is settled
    assert config.dtype == auto_dtype("cpu")
    assert config.torch_dtype == (torch.bfloat16 if native_bf16 else torch.float32)


def test_an_explicit_dtype_is_kept():
    assert EngineConfig(dtype="float32").torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").settled().dtype == "bfloat16"


def test_a_bad_dtype_names_the_field():
    with pytest.raises(ValueError, match="EngineConfig.dtype"):
        EngineConfig(dtype="int3")


def test_the_default_token_budget_follows_the_cpu_and_an_explicit_one_is_kept():
    expected = 128 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 96
    assert cpu_capability() == torch.backends.cpu.get_cpu_capability()  # read without torch, the same answer
    assert SchedulerConfig().max_num_batched_tokens == expected
    assert SchedulerConfig(max_num_batched_tokens=None).max_num_batched_tokens == expected
    assert SchedulerConfig(max_num_batched_tokens=200).max_num_batched_tokens == 200
    # An AVX2-only CPU (what ATEN_CPU_CAPABILITY=avx2 makes this one look like): the smaller budget.
    code = "from serval.config import SchedulerConfig; print(SchedulerConfig().max_num_batched_tokens)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["96"]


def test_the_hardware_line_names_the_cpu_capability_and_bf16_support():
    from serval.platform_info import describe_hardware

    line = describe_hardware()
    assert torch.backends.cpu.get_cpu_capability() in line
    assert ("native bf16: yes" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "native bf16: no") in line


@pytest.mark.parametrize("build, field", [
    (lambda: SchedulerConfig(preemption_mode="evict"), "SchedulerConfig.preemption_mode"),
    (lambda: EngineConfig(scheduler=SchedulerConfig(preemption_mode="swap")), "kv_offload_size"),
    (lambda: CacheConfig(kv_offload_path="/tmp/kv"), "kv_offload_path needs kv_offload_size"),
    (lambda: CacheConfig(kv_offload_size=-1), "CacheConfig.kv_offload_size"),
])
def test_a_second_tier_and_the_preemption_mode_are_checked(build, field):
    with pytest.raises(ValueError, match=field):
        build()
    assert EngineConfig(cache=CacheConfig(kv_offload_size=0.5),
                        scheduler=SchedulerConfig(preemption_mode="swap")).scheduler.preemption_mode == "swap"


# -- defaults that belong to the device ----------------------------------------------------------------------------


def test_device_auto_is_the_default_and_resolves_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this suite's machines, on any machine
    for config in (EngineConfig().settled(), EngineConfig(device="auto").settled()):
        assert config.device == "cpu"
        assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (
            default_token_budget(), CPU_MAX_NUM_SEQS)
        assert (config.cache.kv_cache_memory, config.speculative.max_batch_size) == (
            CPU_KV_CACHE_GIB, CPU_SPECULATIVE_MAX_BATCH_SIZE)
    with pytest.raises(ValueError, match="EngineConfig.device"):
        EngineConfig(device="gpu")


def test_device_auto_picks_cuda_when_torch_sees_a_gpu_and_takes_the_gpus_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing is built on the (absent) GPU here
    config = EngineConfig(device="auto", dtype="float32").settled()
    assert config.device == "cuda"
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (8192, 256)
    assert config.cache.kv_cache_memory is None  # sized by profiling (engine/memory_profile.py)
    assert config.speculative.max_batch_size == CUDA_SPECULATIVE_MAX_BATCH_SIZE
    assert EngineConfig(device="cuda:1", dtype="float32").settled().scheduler.max_num_seqs == 256


def test_values_given_win_over_the_devices_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    scheduler, cache = SchedulerConfig(max_num_seqs=32), CacheConfig(kv_cache_memory=2.0)
    speculative = SpeculativeConfig(max_batch_size=2)
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (default_token_budget(), 32)  # alone: CPU's
    config = EngineConfig(device="cuda", dtype="float32", scheduler=scheduler, cache=cache,
                          speculative=speculative).settled()
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (8192, 32)
    assert (config.cache.kv_cache_memory, config.speculative.max_batch_size) == (2.0, 2)
    # The same configs in a CPU engine after a GPU one: the fields left unset take the CPU's defaults again.
    config = EngineConfig(device="cpu", scheduler=scheduler, cache=cache, speculative=speculative).settled()
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (default_token_budget(), 32)
    explicit = EngineConfig(device="cuda", dtype="float32",
                            scheduler=SchedulerConfig(max_num_batched_tokens=512)).settled()
    assert (explicit.scheduler.max_num_batched_tokens, explicit.scheduler.max_num_seqs) == (512, 256)


@pytest.mark.parametrize("value", [0, -0.5, 1.01, "0.9"])
def test_gpu_memory_utilization_must_be_a_share_of_the_memory(value):
    with pytest.raises(ValueError, match="CacheConfig.gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=value)
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_a_speculative_batch_limit_of_zero_means_never_and_below_is_refused():
    assert SpeculativeConfig(max_batch_size=0).max_batch_size == 0
    with pytest.raises(ValueError, match="SpeculativeConfig.max_batch_size must be an integer >= 0"):
        SpeculativeConfig(max_batch_size=-1)
