"""Linear layers without bias. A module of its own so quantized forms can replace it.

Batch invariance: a row's result must not depend on how many rows share the call, or greedy output would
change with batch composition. CPU GEMM libraries pick a kernel by row count (a matrix-vector path for one
row, other blockings for a few), and some of those sum in another order: measured here, float32 (MKL) gives
three different results for a row at 1, 2-3 and 4+ rows, and bfloat16 (oneDNN) differs at 1-2 rows once the
reduction is longer than 1024. So each weight shape is probed once on the CPU it runs on, and calls are padded
to the smallest row count from which every row's result is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_ROW_PADDINGS = (1, 4, 16, 64)  # tried in order; the first that makes results row-invariant is used
_PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64)
_row_padding_by_shape: dict[tuple, int] = {}


def row_padding(matmul: Callable[[torch.Tensor], torch.Tensor], in_features: int, key: tuple,
                dtype: torch.dtype, device: torch.device) -> int:
    """The smallest row count to pad ``matmul``'s input to so that each row's output is bitwise the same
    whatever the number of rows; probed once per ``key`` (the weight's shape and kind)."""
    key = (*key, dtype, device.type)
    if key not in _row_padding_by_shape:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(max(_PROBE_ROWS), in_features, generator=generator, device=device).to(dtype)
        for padding in _ROW_PADDINGS:
            if _rows_are_invariant(matmul, x, padding):
                break
        else:
            logger.warning("no row padding makes %s linears row-invariant on this device: greedy output may "
                           "depend on batch composition", key)
            padding = 1
        _row_padding_by_shape[key] = padding
    return _row_padding_by_shape[key]


def _rows_are_invariant(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, padding: int) -> bool:
    # A flip shows only where the two sums round differently, so every row is checked alone as well.
    full = padded_matmul(matmul, x, padding)
    if any(not torch.equal(padded_matmul(matmul, x[:m], padding), full[:m]) for m in _PROBE_ROWS):
        return False
    return all(torch.equal(padded_matmul(matmul, x[i: i + 1], padding), full[i: i + 1]) for i in range(len(x)))


def padded_matmul(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """``matmul(x)`` with x [M, in] padded with zero rows up to ``rows``."""
    m = x.shape[0]
    if m >= rows:
        return matmul(x)
    return matmul(F.pad(x, (0, 0, 0, rows - m)))[:m]


def _row_invariant_forward(layer: Linear | Int8Linear, x: torch.Tensor, key: tuple) -> torch.Tensor:
    """``layer._matmul`` over x [..., in] flattened to rows, padded to the layer's probed row count."""
    flat = x.reshape(-1, layer.in_features)
    if layer.min_rows is None:
        layer.min_rows = row_padding(layer._matmul, layer.in_features, key, flat.dtype, flat.device)
    return padded_matmul(layer._matmul, flat, layer.min_rows).view(*x.shape[:-1], layer.out_features)


class Linear(nn.Module):
    """y = x W^T, W stored [out_features, in_features] in the model dtype."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.min_rows: int | None = None  # row padding for batch invariance, probed on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _row_invariant_forward(self, x, ("dense", *self.weight.shape))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
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
        self.min_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _row_invariant_forward(self, x, ("int8", *self.weight_int8.shape))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return F.linear(x, self.weight_int8.to(x.dtype)) * self.scales  # no fused kernel there: dequantize


@torch.inference_mode()
def probe_row_padding(model: nn.Module) -> None:
    """Probes every linear's row padding now, so that the first request does not pay for it."""
    for module in model.modules():
        if isinstance(module, (Linear, Int8Linear)) and module.min_rows is None:
            weight = module.weight if isinstance(module, Linear) else module.scales
            module(torch.zeros(1, module.in_features, dtype=weight.dtype, device=weight.device))


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
