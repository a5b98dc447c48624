"""The fused CPU ops (csrc/fused_ops.cpp): residual add + RMSNorm, RoPE in place, silu(gate) * up and the rows'
argmax, against the PyTorch lines they replace, and each row the same alone or in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serval.layers import cpu_kernels
from serval.layers.activation import silu_and_mul
from serval.layers.norm import RMSNorm
from serval.layers.rotary import RotaryEmbedding

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16]


def reference_norm(x, residual, weight, eps):
    r = x if residual is None else x + residual
    return weight * F.rms_norm(r.float(), weight.shape, eps=eps).to(r.dtype), r


def ulps(dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_pytorch_path(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    residual = (torch.randn(37, 576, generator=g) * 10).to(dtype) if with_residual else None
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    out, r = kernels.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_r = reference_norm(x, residual, weight, 1e-5)
    assert torch.equal(r, want_r)  # the residual stream: the same rounded add
    # The norm's sum runs in another order: at most one rounding step of the dtype apart, relative to each value.
    assert torch.all((out.float() - want_out.float()).abs() <= 2 * ulps(dtype) * want_out.float().abs() + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_uses_the_kernel_and_falls_back(monkeypatch, dtype):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 64).to(dtype)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    fused = norm(x, residual)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    plain = norm(x, residual)
    assert torch.equal(fused[1], plain[1])
    assert torch.allclose(fused[0].float(), plain[0].float(), rtol=2 * ulps(dtype), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_the_pytorch_path(dtype):
    """Queries and keys as the model passes them: a [T, heads, D] view into the wider qkv output."""
    rope = RotaryEmbedding(64, 512, 10000.0)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(23, 20 * 64, generator=g).to(dtype)
    positions = torch.randint(0, 512, (23,), generator=g)
    qk = qkv[:, : 16 * 64].view(23, 16, 64)
    cos = rope.cos[positions].unsqueeze(1).to(dtype)
    sin = rope.sin[positions].unsqueeze(1).to(dtype)
    want = RotaryEmbedding.apply(qk, cos, sin)
    untouched = qkv[:, 16 * 64:].clone()
    kernels.rotary_embedding_(qk, positions, rope.cos, rope.sin)
    if dtype == torch.bfloat16:
        assert torch.equal(qk, want)  # every product and the sum rounded where PyTorch rounds them
    else:  # float32: the compiler may fuse the last multiply-add
        assert torch.allclose(qk, want, rtol=2 * ulps(dtype), atol=1e-6)
    assert torch.equal(qkv[:, 16 * 64:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_alone_or_in_a_batch(dtype):
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(40, 576, generator=g).to(dtype), torch.randn(40, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype)
    batch = kernels.add_rms_norm(x, residual, weight, 1e-5)[0]
    alone = torch.cat([kernels.add_rms_norm(x[i: i + 1], residual[i: i + 1], weight, 1e-5)[0] for i in range(40)])
    assert torch.equal(batch, alone)
    rope = RotaryEmbedding(64, 128, 10000.0)
    q = torch.randn(40, 9, 64, generator=g).to(dtype)
    positions = torch.arange(40) * 3
    together = q.clone()
    kernels.rotary_embedding_(together, positions, rope.cos, rope.sin)
    for i in range(40):
        one = q[i: i + 1].clone()
        kernels.rotary_embedding_(one, positions[i: i + 1], rope.cos, rope.sin)
        assert torch.equal(one, together[i: i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])  # 40: a row that ends inside a vector
def test_silu_and_mul_is_the_pytorch_lines(dtype, width):
    """silu(gate) * up for x = [gate | up], rounded where PyTorch rounds; its exp is the kernels' own (within 2 ulp
    of float32), so a float32 result may differ from torch's in the last bits, a bfloat16 one almost never."""
    x = torch.randn(37, 2 * width, generator=torch.Generator().manual_seed(0)).mul_(4).to(dtype)
    got = kernels.silu_and_mul(x)
    want = F.silu(x[:, :width]) * x[:, width:]
    assert got.dtype == dtype and got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= 4 * ulps(dtype) * want.float().abs() + 1e-30).all()
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.99
    rows = torch.cat([kernels.silu_and_mul(x[i: i + 1]) for i in range(len(x))])
    assert torch.equal(rows, got)
    assert torch.equal(silu_and_mul(x.view(1, 37, -1)), got.view(1, 37, -1))  # the layer the MLP calls


def test_argmax_rows_is_torch_argmax_with_ties_and_nans():
    """The first index of each row's largest value, as torch.argmax: ties go to the first, a NaN wins (the first
    NaN), and every row length's tail (shorter than a vector, or not a multiple of one)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 49152, generator=gen)
    x[1, [40, 4000, 40000]] = 100.0  # a three-way tie
    x[2, [70, 9]] = float("nan")
    x[3, 0] = float("nan")
    x[4, -1] = 1000.0
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))
    assert kernels.argmax_rows(x)[1] == 40 and kernels.argmax_rows(x)[2] == 9
    for n in (1, 5, 16, 17, 33, 47):
        y = torch.randn(3, n, generator=gen)
        assert torch.equal(kernels.argmax_rows(y), y.argmax(-1)), n
