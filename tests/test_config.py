"""EngineConfig: ``dtype="auto"`` resolves to what the hardware computes fast; bad values name their field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, SchedulerConfig, auto_dtype


def test_auto_dtype_follows_native_bf16_support():
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert auto_dtype("cpu") == ("bfloat16" if native_bf16 else "float32")
    config = EngineConfig()  # the default is auto, resolved at construction
    assert config.dtype == auto_dtype("cpu")
    assert config.torch_dtype == (torch.bfloat16 if native_bf16 else torch.float32)


def test_an_explicit_dtype_is_kept():
    assert EngineConfig(dtype="float32").torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"


def test_a_bad_dtype_names_the_field():
    with pytest.raises(ValueError, match="EngineConfig.dtype"):
        EngineConfig(dtype="int3")


def test_the_default_token_budget_follows_the_cpu_and_an_explicit_one_is_kept():
    expected = 128 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 96
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
