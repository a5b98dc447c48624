"""RMSNorm, computed in float32 like the reference implementation, with the residual add fused in; and Gemma's."""

from __future__ import annotations

import functools

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
    checkpoints do). On the CPU one C++ pass (``csrc/fused_ops.cpp``) per call, each row on its own, with the bits of
    the PyTorch lines in ``reference``: the kernel runs only for widths and dtypes where it was seen to give them."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size]; on the kernel path also a [T, heads, size] view whose tokens' heads are contiguous (the
        queries or keys inside the qkv output)."""
        if (kernel := self._kernel(x)) is not None and _rows_readable(x):
            kernels, lanes = kernel
            return kernels.gemma_rms_norm(x, self.weight, self.eps, lanes)[0]
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch lines (transformers' Gemma3RMSNorm): the kernel's bits, and the path off the CPU."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor,
               then: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(then(r), r) with r = residual + self(x), the sum rounded to the dtype: a Gemma sublayer's output normed
        into the residual stream and the next sublayer's input normed from it, in one C++ pass on the CPU."""
        if ((kernel := self._kernel(x)) is not None and x.is_contiguous() and residual.is_contiguous()
                and residual.dtype == x.dtype and then.weight.dtype == x.dtype and then.weight.shape == x.shape[-1:]):
            kernels, lanes = kernel
            return kernels.gemma_rms_norm(x, self.weight, self.eps, lanes, residual, then.weight)
        r = residual + self(x)
        return then(r), r

    def _kernel(self, x: torch.Tensor):
        """(the C++ kernels, PyTorch's vector width) where the kernel gives the PyTorch lines' bits, else None."""
        if self.weight.dtype != x.dtype or (kernels := cpu_kernels.for_device(x.device)) is None:
            return None
        lanes = exact_sum_lanes(kernels, x.shape[-1], x.dtype)
        return None if lanes is None else (kernels, lanes)


@functools.cache
def exact_sum_lanes(kernels, size: int, dtype: torch.dtype) -> int | None:
    """The width of PyTorch's float vectors in its CPU sum (8 for its AVX2 kernel, which it also takes on AVX-512
    CPUs), which sets the order of the sum of squares: the width with which the C++ Gemma norm gives the PyTorch
    lines' bits on random float32 rows of this size (float32, where any other order shows), confirmed on rows of
    this dtype; found once. None if no width does (the PyTorch lines run then)."""
    lanes = next((lanes for lanes in (8, 16, 4) if size >= lanes and _norm_exact(kernels, size, torch.float32, lanes)),
                 None)
    return lanes if lanes is not None and _norm_exact(kernels, size, dtype, lanes) else None


def _norm_exact(kernels, size: int, dtype: torch.dtype, lanes: int) -> bool:
    norm = GemmaRMSNorm(size, 1e-6).to(dtype)
    gen = torch.Generator().manual_seed(size)
    norm.weight.copy_(torch.randn(size, generator=gen))
    x = (torch.randn(128, size, generator=gen) * torch.logspace(-3, 3, 128)[:, None]).to(dtype)
    return torch.equal(kernels.gemma_rms_norm(x, norm.weight, 1e-6, lanes)[0], norm.reference(x))


def _rows_readable(x: torch.Tensor) -> bool:
    """Whether the C++ norm reads x as is: contiguous, or [T, H, D] with each token's H * D values contiguous."""
    return x.is_contiguous() or (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2])
