"""SwiGLU's activation: silu(gate) * up, fused in one C++ pass on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serval.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2n] = [gate | up]; on the CPU one pass (``csrc/fused_ops.cpp``) with the
    PyTorch lines' roundings, saving two aten calls and a temporary per layer and step."""
    n = gate_up.shape[-1] // 2
    if (kernels := cpu_kernels.for_device(gate_up.device)) is not None:
        return kernels.silu_and_mul(gate_up.reshape(-1, 2 * n).contiguous()).view(*gate_up.shape[:-1], n)
    gate, up = gate_up.split(n, dim=-1)
    return F.silu(gate) * up
