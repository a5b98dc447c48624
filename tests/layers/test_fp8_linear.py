"""FP8 linears (--quantization fp8): the e4m3 codes and scales follow their rules (checked against a float64
reference), the CPU emulation computes what torch._scaled_mm computes, a row's output does not depend on its
batch-mates, the head stays unquantized, and a CUDA device without FP8 is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serval.layers import fp8_linear
from serval.layers.fp8_linear import (
    FP8_DTYPE,
    Fp8Linear,
    check_fp8_device,
    emulated_scaled_mm,
    quantize_linears_to_fp8,
    quantize_rows,
)
from serval.layers.linear import Linear

# Every finite e4m3fn value, as float64, with its bit pattern (ties round to the even pattern).
_PATTERNS = torch.arange(256, dtype=torch.uint8)
_VALUES = _PATTERNS.view(FP8_DTYPE).double()
_FINITE = ~torch.isnan(_VALUES)
E4M3_VALUES, E4M3_PATTERNS = _VALUES[_FINITE], _PATTERNS[_FINITE].long()


def reference_codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows' rules in float64: scale amax(|row|) / 448, each t / scale rounded to the nearest e4m3 value
    (ties to the even bit pattern), saturated at ±448."""
    t = t.double()
    scales = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
    q = (t / scales).clamp(-448, 448)
    distance = (q.unsqueeze(-1) - E4M3_VALUES).abs()
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    # Of the nearest values (two at a tie), the one with the even pattern; -0 and +0 are both 0.
    even = nearest & (E4M3_PATTERNS % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, nearest).float().argmax(dim=-1)
    return E4M3_VALUES[pick], scales


@pytest.mark.parametrize("spread", [1e-3, 1.0, 300.0])
def test_codes_and_scales_follow_the_float64_reference(spread):
    generator = torch.Generator().manual_seed(0)
    t = torch.randn(64, 512, generator=generator) * spread
    t[3, 7] = 0.0
    codes, scales = quantize_rows(t)
    want_codes, want_scales = reference_codes(t)
    assert codes.dtype == FP8_DTYPE and scales.dtype == torch.float32 and scales.shape == (64, 1)
    assert torch.equal(scales, want_scales.float())  # one correctly rounded float32 division
    assert torch.equal(codes.double(), want_codes)
    # Each row's largest |t| is ±448 exactly; e4m3 keeps 3 mantissa bits, so a normal code is within 2^-4 of
    # t / scale relatively, a subnormal (below 2^-6) within half its step, 2^-10.
    assert torch.equal(codes.double().abs().amax(dim=-1), torch.full((64,), 448.0, dtype=torch.float64))
    q = t.double() / scales.double()
    error = (codes.double() - q).abs()
    assert (error <= torch.maximum(q.abs() * 2**-4, torch.full_like(q, 2**-10))).all()


def test_a_zero_row_gives_zero_codes_and_too_large_values_saturate():
    codes, scales = quantize_rows(torch.zeros(2, 32))
    assert torch.equal(codes.float(), torch.zeros(2, 32)) and (scales > 0).all()
    # A rounding of t / scale past 448 would be NaN in e4m3fn without the clamp.
    t = torch.tensor([[448.0 * (1 + 2**-20), 1.0, -448.0]])
    codes, _ = quantize_rows(t)
    assert not torch.isnan(codes.float()).any() and codes.float().abs().max() == 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fp8_linear_is_the_float64_product_of_its_codes_and_close_to_dense(dtype, rows):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(384, 256, generator=generator) / 16).to(dtype)
    x = torch.randn(rows, 256, generator=generator).to(dtype)
    layer = Fp8Linear(weight)
    got = layer(x)
    assert got.shape == (rows, 384) and got.dtype == dtype
    x_codes, x_scales = reference_codes(x.float())
    w_codes, w_scales = reference_codes(weight.float())
    exact = (x_codes @ w_codes.T) * x_scales * w_scales.T
    # Only the float32 sums and the one rounding to bfloat16 (2^-9 relatively) stand between the two.
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6 * exact.abs().max()).all()
    # Against the unquantized product: e4m3's 3-bit mantissas round each factor by ~2.6% RMS on Gaussian values;
    # the relative RMS error of the outputs measured 3.5% to 3.8% (4 seeds, 1 to 33 rows), bounded here at 5%.
    dense = x.double() @ weight.double().T
    assert (got.double() - dense).norm() <= 0.05 * dense.norm()


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="no torch._scaled_mm")
def test_the_emulation_computes_what_scaled_mm_computes():
    """torch._scaled_mm with row-wise scales, where this torch has it on the CPU, gives the emulation's bits (the
    two sum the same exact products in float32; their orders may differ, by an ulp of the bfloat16 result at most)."""
    generator = torch.Generator().manual_seed(2)
    x_codes, x_scales = quantize_rows(torch.randn(7, 128, generator=generator))
    w_codes, w_scales = quantize_rows(torch.randn(48, 128, generator=generator))
    try:
        want = torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scales, scale_b=w_scales.view(1, -1),
                                out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm on the CPU: {exc}")
    got = emulated_scaled_mm(x_codes, w_codes, x_scales, w_scales.view(1, -1))
    assert got.dtype == torch.bfloat16
    ulp = got.float().abs() * 2**-7
    assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_each_row_is_the_same_whatever_the_batch(dtype):
    """Activations are scaled per row, so a row's codes are its own; with the probed row padding its output is
    bitwise the same alone or among others: what keeps greedy output batch-invariant."""
    generator = torch.Generator().manual_seed(3)
    layer = Fp8Linear(torch.randn(960, 576, generator=generator) / 24)
    x = torch.randn(40, 576, generator=generator).to(dtype)
    x[5] *= 100  # a loud row would change its batch-mates' codes under one scale for the whole batch
    batch = layer(x)
    alone = torch.cat([layer(x[i: i + 1]) for i in range(len(x))])
    assert torch.equal(batch, alone)
    for rows in (2, 3, 16, 33):
        assert torch.equal(layer(x[:rows]), alone[:rows])


def test_the_decoder_linears_are_swapped_and_the_head_is_not():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].proj = Linear(64, 128)
    model.layers[0].odd = Linear(64, 24)  # 24 outputs: not a shape _scaled_mm takes
    model.lm_head = Linear(64, 256)
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.data.normal_()
    assert quantize_linears_to_fp8(model) == 1
    assert isinstance(model.layers[0].proj, Fp8Linear)
    assert type(model.layers[0].odd) is Linear and type(model.lm_head) is Linear
    assert model.layers[0].proj.weight_fp8.dtype == FP8_DTYPE and model.layers[0].proj.weight_scale.shape == (1, 128)


@pytest.mark.parametrize(("capability", "name"), [((8, 0), "NVIDIA A100-SXM4-80GB"), ((7, 5), "Tesla T4")])
def test_a_cuda_device_below_sm89_is_refused_by_name(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with pytest.raises(ValueError, match=rf"fp8 needs .*8\.9.*; cuda:0 is {name}, capability "
                                         rf"{capability[0]}\.{capability[1]}$"):
        check_fp8_device("cuda:0")
    assert not fp8_linear.fp8_gemm_available("cuda:0")


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_ada_hopper_and_later_are_taken(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    check_fp8_device("cuda:0")
    assert fp8_linear.fp8_gemm_available("cuda:0")


def test_the_cpu_is_told_it_runs_an_emulation(caplog):
    with caplog.at_level("WARNING", logger="serval"):
        check_fp8_device("cpu")
    assert "emulation" in caplog.text


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and fp8_linear.fp8_gemm_available("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA device of compute capability 8.9 or newer")
@torch.inference_mode()
def test_scaled_mm_on_the_gpu_gives_the_emulations_result_and_rows_their_own_bits():
    """On an FP8 GPU the layer runs torch._scaled_mm: the CPU emulation's result up to the order of the float32 sums
    (an ulp of the bfloat16 output), and each row's bits the same alone or in a batch."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(4096, 4096, generator=generator) / 64
    x = torch.randn(80, 4096, generator=generator).to(torch.bfloat16)
    layer = Fp8Linear(weight.cuda())
    got = layer(x.cuda()).cpu()
    want = Fp8Linear(weight)(x)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-3 * want.float().abs().max()).all()
    alone = torch.cat([layer(x[i: i + 1].cuda()) for i in range(len(x))])
    assert torch.equal(layer(x.cuda()), alone)
    for rows in (2, 3, 16, 33, 64):
        assert torch.equal(layer(x[:rows].cuda()), alone[:rows])
