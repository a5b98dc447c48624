"""RMSNorm, computed in float32 like the reference implementation, with the residual add fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serval.layers import cpu_kernels, triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(r), r) with r = x + residual (the residual stream, in x's dtype), or r = x.

        On the CPU one C++ pass (``csrc/fused_ops.cpp``) does the add, the norm and the scale with the same
        roundings as the PyTorch lines below; on CUDA one Triton kernel (``triton_kernels.py``) does."""
        if (fused := triton_ops.for_tensor(x)) is not None:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if x.is_contiguous() and (kernels := cpu_kernels.for_device(x.device)) is not None:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        r = x if residual is None else x + residual
        # Normalised in float32, cast back, then scaled: the reference's order of rounding.
        return self.weight * F.rms_norm(r.float(), self.weight.shape, eps=self.eps).to(r.dtype), r
