"""Linear layers: the int8 weight-only form stays close to the dense one and swaps in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serval.layers.linear import Int8Linear, Linear, quantize_linears


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_int8_linear_is_close_to_dense(dtype, rows):
    torch.manual_seed(0)
    dense = Linear(256, 384)
    dense.weight.data = torch.randn(384, 256).to(dtype)
    x = torch.randn(rows, 256).to(dtype)
    want = torch.nn.functional.linear(x.float(), dense.weight.float())
    got = Int8Linear(dense.weight)(x).float()
    # Per-row int8 rounding: the error is a fraction of a percent of the output scale.
    assert (got - want).abs().max() / want.abs().max() < 0.02
    assert got.shape == (rows, 384) and Int8Linear(dense.weight)(x).dtype == dtype


def test_int8_linear_keeps_leading_dimensions():
    layer = Int8Linear(torch.randn(16, 8))
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 16)


def test_quantize_linears_swaps_every_linear():
    model = nn.Sequential(Linear(8, 8), nn.ReLU(), nn.Sequential(Linear(8, 4)))
    for m in model.modules():
        if isinstance(m, Linear):
            m.weight.data.normal_()
    assert quantize_linears(model, "int8") == 2
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert model(torch.randn(3, 8)).shape == (3, 4)
    with pytest.raises(ValueError, match="quantization"):
        quantize_linears(model, "int3")
