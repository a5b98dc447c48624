"""FP8 linears (--quantization fp8): float8 e4m3 weights quantized once at load with one scale per output channel,
activations quantized on each call with one scale per token.

Per token, not vLLM's default of one dynamic scale for the whole batch: a batch-wide scale is the batch's largest
|x|, so a row's rounding, and so greedy output, would depend on its batch-mates. One scale per row keeps a row's
codes its own, and torch._scaled_mm takes row-wise scales (float32 [M, 1] and [1, N], bfloat16 output) where it
has FP8 at all.

Where the product runs: on CUDA of compute capability 8.9 or newer (Ada, Hopper and on) torch._scaled_mm; older CUDA
devices are refused at load (``check_fp8_device``). On the CPU the same product is emulated (``emulated_scaled_mm``):
the same codes and scales, the codes multiplied and summed in float32, then scaled by both scales and rounded to
bfloat16 once, which is what _scaled_mm computes up to the order of its float32 sums. It widens the weights to
float32 on every call: correct and slow, a way to check the numerics on a machine without a GPU, never a speed-up.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from serval.layers.linear import Linear, padded_matmul, row_padding

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89), Hopper (sm_90) and newer
# A row of zeros (the padding of a batch) gets this amax, so its scale is tiny instead of 0 and its codes 0, not NaN.
_MIN_AMAX = 1e-12
# torch._scaled_mm needs both dimensions of the weight to be multiples of 16; a linear of another shape stays as it is.
_SCALED_MM_MULTIPLE = 16
# The product's output dtype: _scaled_mm's row-wise scaling writes bfloat16 only, so the emulation rounds there too.
OUT_DTYPE = torch.bfloat16


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [R, K] as e4m3 codes [R, K] and one float32 scale per row [R, 1], with t ≈ codes * scale: the scale is
    amax(|row|) / 448, and the codes are t / scale in float32 rounded to nearest even, saturated at ±448."""
    t = t.float()
    scales = t.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    return (t / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def emulated_scaled_mm(x_codes: torch.Tensor, w_codes: torch.Tensor, x_scales: torch.Tensor,
                       w_scales: torch.Tensor) -> torch.Tensor:
    """torch._scaled_mm(x_codes, w_codes.t(), x_scales, w_scales, out_dtype=bfloat16) on any device: codes
    [M, K] and [N, K], scales float32 [M, 1] and [1, N]. The product of two e4m3 values is exact in float32, so only
    the sums round, then the scaled result once to bfloat16."""
    acc = torch.nn.functional.linear(x_codes.float(), w_codes.float())
    return (acc * x_scales * w_scales).to(OUT_DTYPE)


def fp8_gemm_available(device: str | torch.device) -> bool:
    """Whether ``device`` multiplies FP8 in hardware (CUDA, compute capability 8.9 or newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_fp8_device(device: str | torch.device) -> None:
    """Refuses --quantization fp8 on a CUDA device without FP8 tensor cores, naming it; on the CPU says it will be
    an emulation."""
    device = torch.device(device)
    if device.type == "cpu":
        logger.warning("--quantization fp8 on the CPU is an emulation (weights widened to float32 on every call): "
                       "the numerics of a GPU's FP8 GEMMs, slower than --quantization none")
        return
    if device.type != "cuda" or fp8_gemm_available(device):
        return
    major, minor = torch.cuda.get_device_capability(device)
    raise ValueError(f"--quantization fp8 needs FP8 tensor cores (CUDA compute capability 8.9 or newer: Ada, Hopper "
                     f"or later); {device} is {torch.cuda.get_device_name(device)}, capability {major}.{minor}")


class Fp8Linear(nn.Module):
    """y = x W^T with W as e4m3 codes [out, in] and a float32 scale per output channel [1, out]; x quantized per
    row on each call. Returns the input's dtype (through bfloat16, the product's output)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = quantize_rows(weight.detach())
        self.register_buffer("weight_fp8", codes.contiguous())
        self.register_buffer("weight_scale", scales.view(1, -1).contiguous())  # _scaled_mm's scale_b layout
        self.min_rows: int | None = None  # row padding for batch invariance, probed on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.min_rows is None:
            self.min_rows = row_padding(self._matmul, self.in_features, ("fp8", self.out_features, self.in_features),
                                        flat.dtype, flat.device)
        return padded_matmul(self._matmul, flat, self.min_rows).view(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        x_codes, x_scales = quantize_rows(x)
        if x.is_cuda:
            y = torch._scaled_mm(x_codes, self.weight_fp8.t(), scale_a=x_scales, scale_b=self.weight_scale,
                                 out_dtype=OUT_DTYPE)
        else:
            y = emulated_scaled_mm(x_codes, self.weight_fp8, x_scales, self.weight_scale)
        return y.to(x.dtype)

    def probe_row_padding(self, dtype: torch.dtype) -> None:
        """Probes the row padding now (linear.probe_row_padding calls it at load), not in the first request."""
        self(torch.zeros(1, self.in_features, dtype=dtype, device=self.weight_fp8.device))


def quantize_linears_to_fp8(model: nn.Module) -> int:
    """Swaps ``model``'s Linears for Fp8Linears, but the head (``lm_head``: the logits, the last rounding before
    sampling, and where tied the embedding itself; vLLM leaves it unquantized too) and any linear whose shape
    _scaled_mm cannot take (a dimension not a multiple of 16). Returns how many were swapped."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, Linear) or qualified.split(".")[-1] == "lm_head":
                continue
            if child.in_features % _SCALED_MM_MULTIPLE or child.out_features % _SCALED_MM_MULTIPLE:
                logger.info("fp8: %s stays in %s (%d x %d: not multiples of 16)", qualified, child.weight.dtype,
                            child.out_features, child.in_features)
                continue
            setattr(parent, name, Fp8Linear(child.weight))
            swapped += 1
    return swapped
