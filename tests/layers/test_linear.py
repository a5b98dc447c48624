"""Linear layers: the int8 weight-only form stays close to the dense one and swaps in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serval.layers.linear import Int8Linear, Linear, padded_matmul, quantize_linears


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


# The model's own shapes: qkv (576 -> 960), down (1536 -> 576, a reduction past 1024), the lm_head's width.
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 8192)])
@torch.inference_mode()
def test_each_row_is_the_same_whatever_the_batch(dtype, quantized, shape):
    """Batch invariance: a row's output is bitwise the same computed alone or among any number of other rows —
    what keeps greedy output independent of batch composition."""
    in_features, out_features = shape
    torch.manual_seed(1)
    layer = Linear(in_features, out_features)
    layer.weight.data = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype)
    if quantized:
        layer = Int8Linear(layer.weight)
    x = torch.randn(80, in_features).to(dtype)
    batch = layer(x)
    alone = torch.cat([layer(x[i: i + 1]) for i in range(len(x))])
    assert torch.equal(batch, alone)
    for rows in (2, 3, 5, 16, 33):
        assert torch.equal(layer(x[:rows]), alone[:rows])


def test_padded_matmul_pads_and_trims():
    calls = []

    def matmul(x):
        calls.append(x.shape[0])
        return x * 2

    x = torch.ones(3, 4)
    assert torch.equal(padded_matmul(matmul, x, 16), x * 2) and calls == [16]
    assert padded_matmul(matmul, torch.ones(20, 4), 16).shape == (20, 4) and calls[-1] == 20
