"""What the engine runs on, in one line for logs and benchmark reports: CPU model, vector ISA, native bf16."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


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
    bf16 = "yes" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    text = (f"{cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {bf16}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text
