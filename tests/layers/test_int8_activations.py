"""The block kernel with int8 activations (csrc/int8_linear.cpp, EngineConfig.activation_quantization "int8"):
the activations quantized per row and block of 32 (dx = amax / 127, codes rounded to nearest even), integer dot
products with the file's codes, float32 only for the scales. Against a float64 reference of that formula: the
integers exact, the rest float32 rounding; a row alone equals the row in any batch; the error against float
activations is bounded. (The AVX2 build gives the same bits: test_avx2_build.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_bf16_dot_linear import recorded_measurement
from test_block_quant_linear import FORMATS, activations, random_blocks

from serval.config import EngineConfig
from serval.layers import cpu_kernels
from serval.layers import linear as linear_module
from serval.layers.linear import BlockQuantLinear, BlockWeight, use_activation_quantization

kernels = cpu_kernels.load()
needs_int8 = pytest.mark.skipif(kernels is None or not kernels.block_int8_kernel_available(),
                                reason="the int8 kernel needs the C++ kernels and AVX2 (with FMA, F16C) or AVX-512")
# Every layout: the test layouts q4 and q8, the GGUF types (q5, q4k, q5k, q6k), and the K-quants with float32 scales
# per block (q4f, q5f, q6f: a slice that cuts super-blocks).
CASES = [*FORMATS, "Q4_K f32", "Q5_K f32", "Q6_K f32"]


def weight_of(case: str, out_features: int, in_features: int, seed: int = 0) -> BlockWeight:
    weight = random_blocks(case.split()[0], out_features, in_features, seed)
    return weight.with_float32_scales() if case.endswith("f32") else weight


def quantized_activations(x: torch.Tensor, in_features: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's quantization in numpy float32: per block of 32 (zeros past in_features), dx = amax / 127 and
    codes round-to-nearest-even(x / dx). Returns (codes [M, G, 32] int64, dx [M, G] float32)."""
    x = x.float().numpy()
    groups = -(-in_features // 32)
    blocks = np.zeros((len(x), groups * 32), np.float32)
    blocks[:, :in_features] = x
    blocks = blocks.reshape(len(x), groups, 32)
    dx = np.abs(blocks).max(-1) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(dx[..., None] > 0, np.rint(blocks / dx[..., None]), 0)
    return codes.astype(np.int64), dx.astype(np.float32)


def reference(weight: BlockWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y = sum over blocks of dx * sum(w * code), in float64 (w the file's weights, exact), and the sum of the
    magnitudes of its terms (the scale of float32 rounding)."""
    codes, dx = quantized_activations(x, weight.in_features)
    xq = torch.from_numpy(codes * dx[..., None].astype(np.float64)).flatten(1)[:, : weight.in_features]
    w = weight.dequantize().double()
    return xq @ w.T, xq.abs() @ w.abs().T


@needs_int8
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3, 7, 16, 37])
@pytest.mark.parametrize("shape", [(200, 576), (37, 80)])  # a short last panel; a K the blocks pad
def test_int8_kernel_equals_the_quantized_formula(case, rows, shape):
    """Integer sums exact, then per block a float32 product of scales and an FMA: against float64 the error is
    float32 rounding, under 2^-20 of the sum of |terms| (x w's rounding at 2^-24 per step, at most 3 per block)."""
    weight = weight_of(case, *shape)
    x = activations(rows, weight.in_features, torch.float32, seed=rows)
    got = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, shape[0], False)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    want, magnitude = reference(weight, x)
    assert torch.all((got.double() - want).abs() <= 2**-20 * magnitude + 1e-30)


def with_power_of_two_scales(weight: BlockWeight) -> BlockWeight:
    """The weight with scales that make every float32 step of the kernel exact for integer activations: d = 2^-6
    and m = -2^-3 (float16 or float32 per block), or for the K formats d = 2^-10 and -dmin = -2^-9 per super-block
    (the sub-block bytes kept)."""
    if weight.format in ("q8", "q4", "q5"):
        values = torch.tensor([2.0**-6, -(2.0**-3)]).half()
        weight.scales = values[: weight.scales.shape[-1]].expand_as(weight.scales.view(torch.float16)).contiguous()
        weight.scales = weight.scales.view(torch.int16)
    elif weight.format in ("q4f", "q5f", "q6f"):
        values = torch.tensor([2.0**-6, -(2.0**-3)])
        weight.scales = values[: weight.scales.shape[-1]].expand(*weight.scales.shape).contiguous().view(torch.int32)
        if weight.format == "q6f":
            weight.scales = torch.full(weight.scales.shape, 2.0**-6).view(torch.int32)
    else:
        supers = weight.super_scales.view(torch.float16)
        values = torch.tensor([2.0**-10, -(2.0**-9)]).half()[: supers.shape[-1]]
        weight.super_scales = values.expand_as(supers).contiguous().view(torch.int16)
    return weight


@needs_int8
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 2, 5])  # 1 and 2 rows spread a block's dot products over several sums
def test_int8_kernel_integer_sums_are_exact(case, rows):
    """With activations whose blocks have amax 127 (dx = 1: the codes are the rounded x) and weights whose scales
    are small powers of two, every float32 step is exact: the kernel must give the float64 result bit for bit,
    which only exact integer dot products over every code bit (nibbles, fifth and sixth bits, signs) can."""
    weight = with_power_of_two_scales(weight_of(case, 48, 512, seed=5))
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(-127, 128, (5, 512), generator=gen).float()
    x.view(5, 16, 32)[:, :, 3] = 127.0  # amax 127 in every block: dx = 1 exactly
    x = x[:rows]
    got = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 48, False)
    want = x.double() @ weight.dequantize().double().T
    assert torch.equal(got.double(), want)


@needs_int8
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_int8_kernel_largest_sums_are_exact(case, rows):
    """Every code at its largest magnitude (q8: -128; the others 15, 31 or 63) and every activation at 127 or
    -127: the integer sums are at their bounds (a u8 x s8 pair of nibbles 2 * 15 * 127, which the AVX2 kernel adds in
    int16 over a block's 8 steps), and must still be exact, so the result equals float64 bit for bit. The K
    formats' sub-block scales are set to 1 to keep every float32 step exact."""
    weight = with_power_of_two_scales(weight_of(case, 40, 256, seed=3))
    weight.packed = torch.full_like(weight.packed, 0x80 if weight.format == "q8" else 0xFF)
    weight.known_codes = None
    if weight.super_scales is not None:
        weight.scales = torch.ones_like(weight.scales)
    signs = torch.tensor([[1.0] * 8, [-1.0] * 8, [1.0, -1.0] * 4, [-1.0, 1.0] * 4, [1.0, 1.0, -1.0, -1.0] * 2])
    x = (127 * signs[:rows]).repeat_interleave(32, dim=1)  # a sign per block of 32
    got = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 40, False)
    want = x.double() @ weight.dequantize().double().T
    assert torch.equal(got.double(), want)


@needs_int8
@pytest.mark.parametrize("case", ["q4", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 7])
def test_bfloat16_results_are_the_float32_results_rounded(case, rows):
    """The kernel rounds its float32 results to bfloat16 itself (no second pass by torch): exactly as torch does."""
    weight = weight_of(case, 130, 576)
    x = activations(rows, weight.in_features, torch.bfloat16)
    got = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 130, False)
    as_float = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 130, True)
    assert got.dtype == torch.bfloat16 and as_float.dtype == torch.float32
    assert torch.equal(as_float.to(torch.bfloat16), got)


@needs_int8
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_each_row_is_the_same_whatever_the_batch(case, dtype):
    """Batch invariance: a row alone gives bitwise that row's output among 1 to 64 rows (every tile remainder)."""
    layer = BlockQuantLinear(weight_of(case, 130, 576))  # 130 columns: a short last panel
    layer.activation_quantization = "int8"
    x = activations(64, layer.in_features, dtype)
    alone = torch.cat([layer(x[i: i + 1]) for i in range(len(x))])
    for rows in range(1, 65):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@needs_int8
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("outlier", "max_error", "rms_error"), [(False, 0.003, 0.008), (True, 0.02, 0.02)])
def test_int8_activations_stay_near_float_activations(case, outlier, max_error, rms_error):
    """The cost of quantizing the activations against the float kernel, on Gaussian activations: rounding to steps of
    amax / 127 per block (about 0.016 sigma) leaves an error of about 0.5% of the outputs' root mean square and
    0.14% of sum |x w| at most (measured, every format); an outlier channel (x 30) makes its blocks' steps 30 times
    coarser: about 1.1% and 1.3%. Bounds: those, with margin."""
    weight = weight_of(case, 200, 576)
    x = activations(16, weight.in_features, torch.float32)
    if not outlier:
        x[:, 7] /= 30
    exact = kernels.block_panel_linear(x, *weight.panels(), weight.format, 200, False).double()
    got = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 200, False).double()
    w = weight.dequantize().double()
    assert torch.all((got - exact).abs() <= max_error * (x.double().abs() @ w.abs().T))
    assert (got - exact).pow(2).mean().sqrt() <= rms_error * exact.pow(2).mean().sqrt()


@needs_int8
@torch.inference_mode()
def test_the_setting_picks_the_kernel_per_linear():
    """use_activation_quantization sets every block linear; "none" is the float kernel's bits, "int8" the int8
    kernel's, for one row and many alike; a fused weight of several formats uses it in each part."""
    parts = [random_blocks("q4", 64, 256), random_blocks("q8", 32, 256, seed=1)]
    layer = BlockQuantLinear(parts)
    model = torch.nn.Sequential(layer)
    x = activations(9, 256, torch.float32)
    panels = [part.panels() for part in parts]

    def kernel(linear) -> torch.Tensor:
        return torch.cat([linear(x, *p, part.format, part.out_features, False) for part, p in zip(parts, panels)], -1)

    assert use_activation_quantization(model, "int8") == "int8"
    assert torch.equal(layer(x), kernel(kernels.block_panel_linear_int8))
    assert torch.equal(layer(x[:1]), kernel(kernels.block_panel_linear_int8)[:1])
    use_activation_quantization(model, "none")
    assert torch.equal(layer(x), kernel(kernels.block_panel_linear))
    with pytest.raises(ValueError, match="activation_quantization"):
        use_activation_quantization(model, "int4")


@needs_int8
def test_auto_follows_the_measurement(monkeypatch):
    """"auto" is "int8" exactly where int8_activations_faster says so, and the linears take the choice made; the
    measurement times the int8 kernel beside the float ones, on one thread."""
    model = torch.nn.Sequential(BlockQuantLinear(random_blocks("q4", 32, 64)))
    for faster, choice in ((True, "int8"), (False, "none")):
        monkeypatch.setattr(linear_module, "int8_activations_faster", lambda faster=faster: faster)
        assert use_activation_quantization(model, "auto") == choice and model[0].activation_quantization == choice
    monkeypatch.undo()
    measured = linear_module._measure_dot_products(kernels)
    assert {"fma_1", "fma_16", "int8_1", "int8_16"} <= set(measured) and measured["int8_1"] > 0


def test_auto_without_block_linears_is_none():
    """A model with no block linear (dense weights) has nothing for int8 activations to speed up."""
    assert use_activation_quantization(torch.nn.Sequential(torch.nn.Linear(4, 4)), "auto") == "none"


@pytest.mark.parametrize(("measured", "faster"), [
    # an AMD EPYC Zen 2 (AVX2 only): no bfloat16 dot products; int8 2x faster at one row, 1.5x at 16
    ({"fma_1": 120.0, "fma_16": 700.0, "int8_1": 60.0, "int8_16": 460.0}, True),
    # int8 only 1.05x faster at one row: not
    ({"fma_1": 105.0, "fma_16": 700.0, "int8_1": 100.0, "int8_16": 460.0}, False),
    # 1.08x slower at 16 rows: within the margin
    ({"fma_1": 120.0, "fma_16": 700.0, "int8_1": 60.0, "int8_16": 756.0}, True),
    # 1.2x slower at 16 rows: not
    ({"fma_1": 120.0, "fma_16": 700.0, "int8_1": 60.0, "int8_16": 840.0}, False),
    # against the bfloat16 dot products where they are the faster float kernel (an AMD Zen 4's fma and bf16)
    ({"fma_1": 114.0, "bf16_1": 63.0, "fma_16": 688.0, "bf16_16": 419.0, "int8_1": 60.0, "int8_16": 300.0}, False),
    # ... their FMA path at 16 rows, and AMX tiles (an Intel Xeon's fma, bf16 and amx)
    ({"fma_1": 164.0, "bf16_1": 108.0, "amx_1": 101.0, "fma_16": 909.0, "bf16_16": 984.0, "bf16_fmas_16": 919.0,
      "amx_16": 228.0, "int8_1": 50.0, "int8_16": 300.0}, False),
    # no int8 timing (a build without the kernel)
    ({"fma_1": 120.0, "fma_16": 700.0}, False),
])
def test_int8_needs_one_row_faster_and_sixteen_not_slower_than_every_float_kernel(monkeypatch, tmp_path, measured,
                                                                                  faster):
    """int8 activations where they are 1.1x faster at one row than the fastest float kernel timed and at most 1.1x
    slower at 16 rows than the fastest there."""
    recorded_measurement(monkeypatch, tmp_path, measured)
    assert linear_module.int8_activations_faster() is faster


def test_the_config_validates_the_setting():
    assert EngineConfig(device="cpu").activation_quantization == "auto"
    with pytest.raises(ValueError, match="--activation-quantization"):
        EngineConfig(device="cpu", activation_quantization="fp8")
