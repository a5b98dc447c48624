"""The one question every layer asks before its fused CUDA path: are there Triton kernels for this tensor?

On CUDA a decode step is as long as its kernel count (each launch costs 1-2 us even inside a CUDA graph), so the
per-token ops of a decoder layer (residual add + RMSNorm, SiLU-and-mul, RoPE) run as one Triton kernel each
(``triton_kernels.py``) instead of 3-6 elementwise PyTorch kernels. This module imports no triton: a CPU run never
pays for it.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

# SERVAL_TRITON_OPS=0 keeps the PyTorch path on CUDA too (to measure against it, or to rule the kernels out).
ENABLED = os.environ.get("SERVAL_TRITON_OPS", "1") != "0" and importlib.util.find_spec("triton") is not None


def for_tensor(x: torch.Tensor) -> ModuleType | None:
    """The fused kernels (``triton_kernels``) for ``x`` on CUDA; None elsewhere or when turned off (the caller then
    takes its PyTorch path)."""
    if not (x.is_cuda and ENABLED):
        return None
    from serval.layers import triton_kernels  # imports triton: only once a CUDA tensor asks

    return triton_kernels
