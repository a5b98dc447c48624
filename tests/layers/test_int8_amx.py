"""The int8-activation kernel on AMX tiles (csrc/int8_linear.cpp, amx_panels): a block's integer sums by one tile dot
product, then the vector kernel's float32 steps in the same order, so every output has the vector kernel's bits, for
any row count (batch invariance across the kernels). Runs where the CPU has AMX-INT8 (Sapphire Rapids and later)."""

from __future__ import annotations

import pytest
import torch
from test_block_quant_linear import activations
from test_int8_activations import CASES, weight_of

from serval.layers import cpu_kernels

kernels = cpu_kernels.load()
needs_amx = pytest.mark.skipif(kernels is None or not kernels.block_int8_amx_available(),
                               reason="needs the C++ kernels on a CPU with AMX-INT8")
# Every format but the q6 ones (q6k, q6f: two sums per block, left to the vector kernel): the embedded model's Q4_1
# ("q4") and Q8_0 ("q8"), the fifth bit (Q5_0, Q5_1, Q5_K) and the K-quant scales (Q4_K, and cut: q4f, q5f).
AMX_CASES = [case for case in CASES if not case.startswith("Q6_K")]


@needs_amx
@pytest.mark.parametrize("case", AMX_CASES)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 100])  # below, at and past one tile of 16 rows
@pytest.mark.parametrize("shape", [(200, 576), (37, 80)])  # a short last panel; a K the blocks pad
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_gives_the_vector_kernels_bits(case, rows, shape, dtype):
    weight = weight_of(case, *shape)
    x = activations(rows, weight.in_features, dtype, seed=rows)
    args = (x, *weight.panels(), weight.format, shape[0], False)
    vector = kernels.block_panel_linear_int8(*args, kernel="vector")
    assert torch.equal(kernels.block_panel_linear_int8(*args, kernel="amx"), vector)
    assert torch.equal(kernels.block_panel_linear_int8(*args), vector)  # "auto": tiles from 64 rows (100)


@needs_amx
@pytest.mark.parametrize("case", ["q4", "q8", "Q5_1"])
def test_amx_integer_sums_are_exact_at_the_extremes(case):
    """Codes at their extremes (activations +-127, q8 weights -128 and 127, nibbles 0 and 15, the fifth bit set) and
    dx = 1, scales powers of two: every float32 step is exact, so the result must be float64's bit for bit."""
    weight = weight_of(case, 48, 512, seed=5)
    if case == "q8":
        codes = torch.tensor([-128, 127], dtype=torch.int8).view(torch.uint8)
        weight.packed = codes[torch.randint(0, 2, weight.packed.shape, generator=torch.Generator().manual_seed(3))]
        weight.scales = torch.full(weight.scales.shape, 2.0**-6).half().view(torch.int16)
    else:
        weight.packed = torch.full_like(weight.packed, 0xF0 if case == "q4" else 0xFF)
        d_m = torch.tensor([2.0**-6, -(2.0**-3)]).half().expand(*weight.scales.shape).contiguous()
        weight.scales = d_m.view(torch.int16)
    x = torch.where(torch.rand(40, 512, generator=torch.Generator().manual_seed(4)) < 0.5, -127.0, 127.0)
    got = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 48, False, kernel="amx")
    assert torch.equal(got.double(), x.double() @ weight.dequantize().double().T)


@needs_amx
def test_q6_formats_are_left_to_the_vector_kernel():
    weight = weight_of("Q6_K", 48, 512)
    x = activations(64, 512, torch.float32)
    with pytest.raises(RuntimeError, match="no AMX kernel"):
        kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 48, False, kernel="amx")
    auto = kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 48, False)
    assert torch.equal(auto, kernels.block_panel_linear_int8(x, *weight.panels(), weight.format, 48, False,
                                                             kernel="vector"))


@pytest.mark.skipif(kernels is None or not kernels.block_int8_kernel_available(), reason="needs the int8 kernel")
def test_a_kernel_name_is_checked():
    weight = weight_of("q4", 16, 64)
    with pytest.raises(RuntimeError, match="kernel: auto, vector or amx"):
        kernels.block_panel_linear_int8(torch.ones(1, 64), *weight.panels(), "q4", 16, False, kernel="tiles")
