"""The one place that chooses how attention runs: once, when a runner starts."""

from __future__ import annotations

import importlib.util
import os

import torch

from serval.layers import cpu_kernels
from serval.layers.attention.base import AttentionBackend
from serval.layers.attention.cpu_kernel import CpuKernelBackend
from serval.layers.attention.kv_rows import KV_CODE_DTYPES
from serval.layers.attention.torch_reference import TorchReferenceBackend


def select_backend(device: torch.device | str, dtype: torch.dtype, block_size: int) -> AttentionBackend:
    """The attention backend for steps on ``device`` over a cache of ``dtype`` (the model's dtype or an 8-bit code
    dtype) in blocks of ``block_size`` tokens: the C++ kernel on a CPU where it is built; on CUDA with a cache of the
    model's dtype and Triton importable, the Triton paged kernel (``triton_paged.py``); the PyTorch reference
    elsewhere (8-bit caches on CUDA, no compiler, SERVAL_CPU_KERNELS=0), or wherever the environment sets
    SERVAL_ATTENTION_BACKEND=torch."""
    device = torch.device(device)
    if os.environ.get("SERVAL_ATTENTION_BACKEND") == "torch":
        return TorchReferenceBackend(device, dtype, block_size)
    if device.type == "cuda" and dtype not in KV_CODE_DTYPES.values() and importlib.util.find_spec("triton"):
        from serval.layers.attention.triton_paged import TritonPagedBackend  # imports triton: only when chosen

        return TritonPagedBackend(device, dtype, block_size)
    kernels = cpu_kernels.for_device(device)
    if kernels is not None:
        return CpuKernelBackend(device, dtype, block_size, kernels)
    return TorchReferenceBackend(device, dtype, block_size)
