"""SwiGLU's activation: silu(gate) * up, fused in one C++ pass on the CPU and one Triton kernel on CUDA."""

from __future__ import annotations

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
