"""Linear layers without bias. A module of its own so quantized forms can replace it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T, W stored [out_features, in_features] in the model dtype."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Int8Linear(nn.Module):
    """Weight-only int8: one scale per output row, activations stay in the model dtype.

    Half the bytes of bf16 to read per step, which is what a memory-bound decode pays for."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-10) / 127
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        else:  # no fused kernel there: dequantize on the fly
            out = F.linear(flat, self.weight_int8.to(flat.dtype)) * self.scales
        return out.view(*x.shape[:-1], self.out_features)


QUANTIZATIONS = ("int8",)


def quantize_linears(model: nn.Module, method: str) -> int:
    """Swaps every Linear of ``model`` for its quantized form; returns how many were swapped."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear(child.weight))
                swapped += 1
    return swapped
