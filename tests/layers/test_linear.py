"""Linear layers: the int8 weight-only form stays close to the dense one and swaps in place; dense weights laid out
for the CPU kernel equal float64 closely and need no row padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serval.layers import cpu_kernels
from serval.layers.linear import Int8Linear, Linear, lay_out_for_cpu_kernels, padded_matmul, quantize_linears
from serval.layers.moe import Experts


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


kernels = cpu_kernels.load()
needs_dense_kernel = pytest.mark.skipif(kernels is None or not kernels.block_panel_kernel_available(),
                                        reason="the dense kernel needs the C++ kernels and AVX2 (FMA, F16C) or AVX-512")


def laid_out_linear(in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0) -> Linear:
    """A Linear with weights of a trained layer's size, laid out for the CPU kernel as load_model lays it out."""
    layer = Linear(in_features, out_features)
    gen = torch.Generator().manual_seed(seed)
    layer.weight.data = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    assert lay_out_for_cpu_kernels(layer, bfloat16_linears=True) == 1
    return layer


@needs_dense_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 37])
@pytest.mark.parametrize("shape", [(576, 200), (80, 37), (1536, 64)])  # a short last tile; K not a multiple of 32
def test_the_dense_kernel_equals_float64(dtype, rows, shape):
    """Each output is one float32 FMA chain over the inputs by the exact (widened) weights: against float64 the
    error is float32 summation (K * 2^-24 of sum |x w|, under 1e-4 here) plus the output's rounding to x's dtype."""
    layer = laid_out_linear(*shape, dtype)
    x = torch.randn(rows, shape[0], generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[:, 7] *= 30  # an outlier channel
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, shape[1])
    want = x.double() @ layer.weight.double().T
    rounding = 2**-8 if dtype == torch.bfloat16 else 2**-24
    bound = 1e-4 * (x.double().abs() @ layer.weight.double().abs().T) + rounding * want.abs()
    assert torch.all((got.double() - want).abs() <= bound)
    float_output = kernels.dense_panel_linear(x, layer.weight.t(), True)
    assert float_output.dtype == torch.float32 and torch.equal(float_output.to(dtype), got)


@needs_dense_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_dense_kernel_needs_no_row_padding(dtype):
    """Batch invariance with no padding at all: every row count from 1 to 64 (the inline and buffered paths, all
    tile remainders), for the shapes the probe padded to 16 (float32) and 64 (bfloat16) rows on an Intel Xeon."""
    for shape in ((1536, 512), (512, 770)):
        layer = laid_out_linear(*shape, dtype)
        x = torch.randn(64, shape[0], generator=torch.Generator().manual_seed(3)).to(dtype)
        alone = torch.cat([layer(x[i: i + 1]) for i in range(len(x))])
        assert layer.min_rows == 1
        for rows in range(1, 65):
            assert torch.equal(layer(x[:rows]), alone[:rows]), (shape, rows)


@needs_dense_kernel
def test_laying_out_keeps_one_copy_and_tied_weights_tied():
    """The weight keeps its shape, values and parameter (a tied head stays the embedding's, which still looks up
    the same rows); in memory it is W^T, one copy; a float16 weight (no kernel format) is left as it is."""
    model = nn.Module()
    model.embed = nn.Embedding(300, 64)
    model.head, model.fp16 = Linear(64, 300), Linear(64, 8)
    model.head.weight = model.embed.weight
    model.fp16.weight.data = torch.randn(8, 64).half()
    before = model.embed.weight.detach().clone()
    parameter = model.head.weight
    assert lay_out_for_cpu_kernels(model) == 1 and lay_out_for_cpu_kernels(model) == 0
    assert model.head.weight is parameter is model.embed.weight
    assert torch.equal(parameter, before) and parameter.t().is_contiguous()
    assert parameter.untyped_storage().nbytes() == before.numel() * before.element_size()
    assert not model.fp16.weight.t().is_contiguous()
    ids = torch.tensor([0, 299, 17])
    assert torch.equal(model.embed(ids), before[ids])
    assert torch.equal(model.head(torch.eye(64)[:5]), before.T[:5])


@needs_dense_kernel
@pytest.mark.parametrize("amx", [False, True], ids=["no AMX", "AMX"])
def test_bfloat16_linears_stay_on_onednn_where_it_has_amx(monkeypatch, amx):
    """The default choice: the stacked experts and float32 Linears always take the kernel; bfloat16 Linears unless
    oneDNN runs their GEMMs on AMX tiles (faster from 16 rows up)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    model = nn.Module()
    model.f32, model.bf16 = Linear(64, 32), Linear(64, 32)
    model.bf16.weight.data = torch.randn(32, 64).bfloat16()
    model.experts = Experts(2, 64, 32).to(torch.bfloat16)
    assert lay_out_for_cpu_kernels(model) == (3 if amx else 4)
    assert model.f32.weight.t().is_contiguous() and model.bf16.weight.t().is_contiguous() is not amx
    assert model.experts.gate_up_proj.transpose(1, 2).is_contiguous()
    assert model.experts.down_proj.transpose(1, 2).is_contiguous()
