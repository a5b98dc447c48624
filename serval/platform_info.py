"""What the engine runs on, in one line for logs and benchmark reports: CPU model, vector ISA, native bf16."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# ATen's CPU capabilities on x86, narrowest first, with the /proc/cpuinfo flags each needs (as ATen checks them).
_CAPABILITY_FLAGS = (("DEFAULT", set()), ("AVX2", {"avx2", "fma"}),
                     ("AVX512", {"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"}))


def cpu_capability() -> str:
    """``torch.backends.cpu.get_cpu_capability()`` on x86, read without importing torch (the server's process has
    no torch): the widest of DEFAULT, AVX2 and AVX512 the CPU has, lowered by ATEN_CPU_CAPABILITY as ATen lowers
    it. tests/test_config.py checks that both agree."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    names = [name for name, needs in _CAPABILITY_FLAGS if needs <= flags]
    asked = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    if asked in names:  # ATen takes a capability the CPU has, never a wider one
        return asked
    return names[-1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_hardware() -> str:
    """E.g. 'AMD EPYC, capability AVX512, native bf16: yes, 2 threads, torch 2.13.0+cpu'."""
    import torch

    bf16 = "yes" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    text = (f"{cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {bf16}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text
