"""Fused Triton kernels for a decoder layer's per-token ops on CUDA (chosen by ``triton_ops.for_tensor``).

Each kernel does in one launch what the PyTorch lines of its caller do in several, with the same roundings: float32
arithmetic, rounded to the tensor's dtype exactly where PyTorch rounds (as the C++ CPU kernels do), so the CUDA
path's results stay those of the PyTorch path up to the last bit of a sum or an exp. Every program works on one row
(a token) alone, so a row's result never depends on its batch-mates or the row count (batch invariance), and the grid
depends only on tensor shapes, with no host sync, so a launch can be captured in a CUDA graph.

The tests call these on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns a SiLU-and-mul program takes: a row of any width runs in cdiv(n, SILU_BLOCK) programs


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(r), r) with r = x + residual rounded to x's dtype (or r = x), as ``RMSNorm.forward``."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        new_residual, res = x, rows  # res is not read
    else:
        res = residual.reshape(-1, n)
        if res.stride(-1) != 1:
            res = res.contiguous()
        new_residual = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, new_residual, rows.stride(0), res.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape), new_residual.view(x.shape)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 x rounded to ``dtype`` (to nearest even), held in float32. bfloat16 by bits: Triton's CPU interpreter
    casts to it by truncation, and on the GPU a cast there and back may be folded away (seen on an H200: RoPE off by
    one step of bf16 where PyTorch rounds its products)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, weight_ptr, out_ptr, new_res_ptr, x_stride, res_stride, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    dtype = x.dtype
    r = x.to(tl.float32)
    if HAS_RESIDUAL:  # the residual stream, rounded to x's dtype as PyTorch's add
        res = tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0)
        r = _rounded(r + res.to(tl.float32), dtype)
        tl.store(new_res_ptr + row * n + cols, r.to(dtype), mask=ok)
    inv_rms = 1.0 / tl.sqrt(tl.sum(r * r, 0) / n + eps)
    normed = _rounded(r * inv_rms, dtype)  # normalised in float32, cast back, then scaled
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * n + cols, _rounded(weight * normed, out_dtype).to(out_dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2n] = [gate | up], as ``activation.silu_and_mul``."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, SILU_BLOCK))](
            rows, out, rows.stride(0), n, BLOCK=SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    e = tl.exp(-tl.abs(g))  # e^-|g| <= 1: no overflow for very negative g
    silu = tl.where(g >= 0, g / (1.0 + e), g * e / (1.0 + e))
    silu = _rounded(silu, gate.dtype)  # F.silu's result, rounded, then the product rounded
    tl.store(out_ptr + row * n + cols, _rounded(silu * up, gate.dtype).to(gate.dtype), mask=ok)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, D] in place by each token's position (the tables cos, sin [max_position, D] float32 read
    inside the kernel: no gathered copies), as ``RotaryStep.rotate_``'s PyTorch path: x * cos + rotate_half(x) * sin
    with cos and sin rounded to x's dtype and each product rounded."""
    num_tokens, heads, dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("rotary_: each head's values must be contiguous")
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads,
            HEADS_PAD=triton.next_power_of_2(heads), DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
            enable_fp_fusion=False)  # x * cos + rotated * sin as two rounded products and a sum, not an FMA
    return x


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, x_stride_t, x_stride_h, table_stride, heads,
                   HEADS_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    half = DIM // 2
    dim_ok = d < DIM
    ok = (h < heads)[:, None] & dim_ok[None, :]
    partner = tl.where(d < half, d + half, d - half)  # rotate_half: [-x[half:], x[:half]]
    sign = tl.where(d < half, -1.0, 1.0)
    row = x_ptr + token * x_stride_t + h[:, None] * x_stride_h
    x = tl.load(row + d[None, :], mask=ok, other=0.0)
    rotated = tl.load(row + partner[None, :], mask=ok, other=0.0).to(tl.float32) * sign[None, :]
    dtype = x.dtype
    c = _rounded(tl.load(cos_ptr + pos * table_stride + d, mask=dim_ok, other=0.0), dtype)
    s = _rounded(tl.load(sin_ptr + pos * table_stride + d, mask=dim_ok, other=0.0), dtype)
    a = _rounded(x.to(tl.float32) * c[None, :], dtype)
    b = _rounded(rotated * s[None, :], dtype)
    tl.store(row + d[None, :], _rounded(a + b, dtype).to(dtype), mask=ok)
