"""The gated MLPs' activations: SwiGLU's silu(gate) * up (one C++ pass on the CPU, one Triton kernel on CUDA)
and GeGLU's gelu_tanh(gate) * up (one C++ pass on the CPU)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from serval.layers import cpu_kernels, triton_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2n] = [gate | up]; on the CPU one pass (``csrc/fused_ops.cpp``, its
    bfloat16 case 16 lanes at a time in ``csrc/bf16_rows.cpp``, the same bits) with the PyTorch lines' roundings,
    saving two aten calls and a temporary per layer and step; on CUDA one Triton kernel."""
    if (fused := triton_ops.for_tensor(gate_up)) is not None:
        return fused.silu_and_mul(gate_up)
    n = gate_up.shape[-1] // 2
    if (kernels := cpu_kernels.for_device(gate_up.device)) is not None:
        return kernels.silu_and_mul_v16(gate_up.reshape(-1, 2 * n).contiguous()).view(*gate_up.shape[:-1], n)
    gate, up = gate_up.split(n, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up [..., 2n] = [gate | up] (Gemma's MLP); on the CPU one C++
    pass with the bits of the PyTorch lines below (for widths and dtypes where it was seen to give them)."""
    n = gate_up.shape[-1] // 2
    if ((kernels := cpu_kernels.for_device(gate_up.device)) is not None
            and (lanes := exact_gelu_lanes(kernels, n, gate_up.dtype)) is not None):
        return kernels.gelu_tanh_and_mul(gate_up.reshape(-1, 2 * n).contiguous(), lanes).view(*gate_up.shape[:-1], n)
    return _gelu_tanh_and_mul_reference(gate_up)


def _gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@functools.cache
def exact_gelu_lanes(kernels, n: int, dtype: torch.dtype) -> int | None:
    """The width of PyTorch's float vectors in its gelu kernel on this CPU (16 with AVX-512, 8 with AVX2), which
    decides which values its elementwise loop takes in vectors (SLEEF's tanh) and which one by one (libm's): the
    width with which the C++ GeGLU gives the PyTorch lines' bits on float32 rows 60 wide (where each width splits
    them differently), confirmed on rows of this width and dtype; found once. None if no width does. (Past 32768
    values PyTorch splits its loop among threads at offsets of its own; with a thread count that is not a power of
    two a split can fall mid-vector, and the few values there take libm's tanh in PyTorch but SLEEF's here.)"""
    lanes = next((lanes for lanes in (16, 8, 4) if _geglu_exact(kernels, 60, torch.float32, lanes)), None)
    return lanes if lanes is not None and _geglu_exact(kernels, n, dtype, lanes) else None


def _geglu_exact(kernels, n: int, dtype: torch.dtype, lanes: int) -> bool:
    gate_up = (torch.randn(max(8, 4096 // n), 2 * n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype)
    return torch.equal(kernels.gelu_tanh_and_mul(gate_up, lanes), _gelu_tanh_and_mul_reference(gate_up))
