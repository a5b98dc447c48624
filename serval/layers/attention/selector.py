"""The one place that chooses how attention runs: once, when a runner starts."""

from __future__ import annotations

import torch

from serval.layers import cpu_kernels
from serval.layers.attention.base import AttentionBackend
from serval.layers.attention.cpu_kernel import CpuKernelBackend
from serval.layers.attention.torch_reference import TorchReferenceBackend


def select_backend(device: torch.device | str, dtype: torch.dtype, block_size: int) -> AttentionBackend:
    """The attention backend for steps on ``device`` over a cache of ``dtype`` (the model's dtype or an 8-bit code
    dtype) in blocks of ``block_size`` tokens: the C++ kernel on a CPU where it is built; the PyTorch reference
    elsewhere (CUDA, no compiler, SERVAL_CPU_KERNELS=0). The kernel's backend keeps the reference for the layers
    it hands over (soft-capped scores)."""
    device = torch.device(device)
    kernels = cpu_kernels.for_device(device)
    reference = TorchReferenceBackend(device, dtype, block_size)
    if kernels is not None:
        return CpuKernelBackend(device, dtype, block_size, kernels, reference)
    return reference
