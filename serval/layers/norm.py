"""RMSNorm, computed in float32 like the reference implementation, with the residual add fused in; and Gemma's."""

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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32, cast back once (``weight`` holds w, as the reference's
    checkpoints do). On the CPU one C++ pass (``csrc/fused_ops.cpp``) per call, each row on its own."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size]; on the kernel path also a [T, heads, size] view whose tokens' heads are contiguous (the
        queries or keys inside the qkv output)."""
        if (kernels := self._kernels(x)) is not None and _rows_readable(x):
            return kernels.gemma_rms_norm(x, self.weight, self.eps)[0]
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor,
               then: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(then(r), r) with r = residual + self(x), the sum rounded to the dtype: a Gemma sublayer's output normed
        into the residual stream and the next sublayer's input normed from it, in one C++ pass on the CPU."""
        if ((kernels := self._kernels(x)) is not None and x.is_contiguous() and residual.is_contiguous()
                and residual.dtype == x.dtype and then.weight.dtype == x.dtype):
            return kernels.gemma_rms_norm(x, self.weight, self.eps, residual, then.weight)
        r = residual + self(x)
        return then(r), r

    def _kernels(self, x: torch.Tensor):
        return cpu_kernels.for_device(x.device) if self.weight.dtype == x.dtype else None


def _rows_readable(x: torch.Tensor) -> bool:
    """Whether the C++ norm reads x as is: contiguous, or [T, H, D] with each token's H * D values contiguous."""
    return x.is_contiguous() or (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2])
