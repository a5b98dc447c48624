"""csrc/bf16_rows.cpp: silu(gate) * up on bfloat16 rows 16 lanes at a time gives the bits of fused_ops.cpp's
silu_and_mul (which converts each value by scalar code), for every value class and row length, each row alone or
in a batch, and the same bits from the AVX2 build (``SERVAL_CPU_ISA=avx2``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serval.layers import activation, cpu_kernels

HERE = Path(__file__).parent
kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")

WIDTHS = [1536, 40, 16, 17, 1, 33]  # whole vectors, and rows that end inside one


def gate_ups(width: int, rows: int = 37, seed: int = 0) -> torch.Tensor:
    """bfloat16 [rows, 2 * width]: normal values of several magnitudes, and in the first rows every special class
    (NaN, infinities, signed zeros, subnormals, the largest finite values, silu(gate) * up past the largest)."""
    gen = torch.Generator().manual_seed(seed + width)
    x = torch.randn(rows, 2 * width, generator=gen)
    x *= torch.tensor([10.0 ** e for e in range(-3, 4)]).repeat(rows)[:rows, None]
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-39, -1e-39, 3e38, -3e38,
                             88.0, -88.0, 1e-45, 2.0**-126, -(2.0**-126), 65504.0, 1.0])
    flat = x[:3].reshape(-1)
    flat[: min(flat.numel(), 3 * len(specials))] = specials.repeat(3)[: flat.numel()][torch.randperm(
        min(flat.numel(), 3 * len(specials)), generator=gen)]
    return x.to(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("width", WIDTHS)
def test_bfloat16_rows_give_the_scalar_codes_bits(width):
    x = gate_ups(width)
    assert same_bits(kernels.silu_and_mul_v16(x), kernels.silu_and_mul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_take_the_scalar_code(dtype):
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(kernels.silu_and_mul_v16(x), kernels.silu_and_mul(x))


def test_each_row_is_the_same_alone_or_in_a_batch():
    x = gate_ups(1536)
    batch = kernels.silu_and_mul_v16(x)
    assert same_bits(torch.cat([kernels.silu_and_mul_v16(x[i: i + 1]) for i in range(len(x))]), batch)


def test_the_mlp_activation_takes_it(monkeypatch):
    """The layer the MLP calls reaches the vector path for bfloat16, with its bits."""
    x = gate_ups(1536, rows=4)
    calls = []
    vector = kernels.silu_and_mul_v16
    monkeypatch.setattr(kernels, "silu_and_mul_v16", lambda t: calls.append(t.shape) or vector(t))
    got = activation.silu_and_mul(x.view(2, 2, -1))
    assert calls == [(4, 3072)] and same_bits(got.view(4, -1), kernels.silu_and_mul(x))


SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from serval.layers import cpu_kernels
from test_bf16_rows import WIDTHS, gate_ups
k = cpu_kernels.load()
assert k.__name__.startswith("serval_cpu_kernels_avx2_"), k
torch.save({w: k.silu_and_mul_v16(gate_ups(w)) for w in WIDTHS}, sys.argv[1])
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2")
def test_the_avx2_build_gives_the_same_bits(tmp_path):
    """The AVX2 build (two 8-lane halves, another narrowing sequence) against this machine's build; the AVX2 module
    is the one test_avx2_build.py builds (the same sources and flags), so the suite builds it once."""
    env = {**os.environ, "SERVAL_CPU_ISA": "avx2"}
    subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "avx2.pt"), str(HERE)], check=True, env=env,
                   cwd=HERE.parents[1], timeout=900)
    avx2 = torch.load(tmp_path / "avx2.pt")
    assert list(avx2) == WIDTHS
    for width in WIDTHS:
        assert same_bits(avx2[width], kernels.silu_and_mul_v16(gate_ups(width))), width
