"""A MoE layer's experts in one C++ call (csrc/moe_experts.cpp), where they are laid out for the CPU kernel: the
slots are the bits of the PyTorch loop over experts (layers/moe.py ``grouped_slots``), for every expert with zero,
one or many rows (1 to 9 each), on an expert-parallel rank's share too, and a row's slots do not depend on the rows
beside it."""

from __future__ import annotations

import pytest
import torch

from serval.layers import cpu_kernels
from serval.layers.linear import lay_out_for_cpu_kernels
from serval.layers.moe import SparseMoE

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.block_panel_kernel_available(),
                                reason="the dense kernel needs the C++ kernels and AVX2 (FMA, F16C) or AVX-512")

# Widths off the kernel's tiles (32 columns, blocks of 32 inputs), so that partial tiles and blocks are run.
HIDDEN, WIDTH, EXPERTS, TOP_K = 80, 56, 6, 2


def _moe(dtype: torch.dtype, local_experts: tuple[int, int] | None = None) -> SparseMoE:
    gen = torch.Generator().manual_seed(0)
    moe = SparseMoE(HIDDEN, WIDTH, EXPERTS, TOP_K, True, local_experts)
    count = moe.experts.gate_up_proj.shape[0]
    first = moe.first_expert
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen))
        gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) / HIDDEN**0.5
        down = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) / WIDTH**0.5
        moe.experts.gate_up_proj.copy_(gate_up[first: first + count])
        moe.experts.down_proj.copy_(down[first: first + count])
    return moe.to(dtype)


def _rows(dtype: torch.dtype, rows: int = 48) -> torch.Tensor:
    """Hidden states whose routing leaves expert 0 without a row and gives expert 1 exactly one."""
    moe = _moe(torch.float32)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids = moe.route(x)[1]
        x = x[~(ids == 0).any(-1)]
        ids = moe.route(x)[1]
        ones = (ids == 1).any(-1)
        x = torch.cat([x[~ones], x[ones][:1]])
    return x.to(dtype)


def _one_call(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return kernels.moe_expert_slots(x, ids, weights, moe.experts.gate_up_proj.transpose(1, 2),
                                    moe.experts.down_proj.transpose(1, 2), moe.first_expert)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("local_experts", [None, (2, 5)], ids=["all experts", "a rank's experts 2-4"])
def test_the_one_call_gives_the_loop_over_experts_bits(dtype, local_experts):
    moe = _moe(dtype, local_experts)
    lay_out_for_cpu_kernels(moe, bfloat16_linears=True)
    x = _rows(dtype)
    with torch.inference_mode():
        weights, ids = moe.route(x)
        counts = torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
        assert counts[0] == 0 and counts[1] == 1 and min(counts[2:]) > 1
        got = _one_call(moe, x, weights, ids)
        want = moe.grouped_slots(x, weights, ids).view(got.shape)
    assert torch.equal(got, want)
    mine = (ids >= moe.first_expert) & (ids < moe.end_expert)
    assert got[mine].abs().sum(-1).min() > 0 and not got[~mine].any()  # other ranks' slots stay zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_one_call_gives_the_loops_bits_for_every_count_of_rows_an_expert_gets(dtype):
    """1 to 9 rows an expert: a decode step's few (csrc/moe_experts.cpp's own schedule, up to 7 bfloat16 rows) and
    more (dense_panel_linear's)."""
    moe = _moe(dtype)
    lay_out_for_cpu_kernels(moe, bfloat16_linears=True)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.inference_mode():
        for rows in range(1, len(x) + 1):
            # every row routed to experts 2 and 4, so each gets exactly ``rows`` rows
            ids = torch.tensor([[2, 4]] * rows)
            weights = torch.rand(rows, TOP_K, generator=torch.Generator().manual_seed(rows))
            got = _one_call(moe, x[:rows], weights, ids)
            assert torch.equal(got, moe.grouped_slots(x[:rows], weights, ids).view(got.shape)), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_slots_are_the_same_alone_as_in_the_batch(dtype):
    moe = _moe(dtype)
    lay_out_for_cpu_kernels(moe, bfloat16_linears=True)
    x = _rows(dtype)
    with torch.inference_mode():
        weights, ids = moe.route(x)
        whole = _one_call(moe, x, weights, ids)
        for i in range(len(x)):
            assert torch.equal(_one_call(moe, x[i: i + 1], weights[i: i + 1], ids[i: i + 1]), whole[i: i + 1])


def test_forward_runs_the_one_call_only_where_the_experts_are_laid_out(monkeypatch):
    laid, plain = _moe(torch.bfloat16), _moe(torch.bfloat16)
    lay_out_for_cpu_kernels(laid, bfloat16_linears=True)
    x = _rows(torch.bfloat16)
    with torch.inference_mode():
        want = plain(x)
        monkeypatch.setattr(SparseMoE, "grouped_slots", lambda *args: pytest.fail("the loop over experts ran"))
        laid(x)
        assert laid.experts.kernels is not None
        monkeypatch.undo()
        assert plain.experts.kernels is None and torch.equal(plain(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_slots_summed_in_one_pass_are_the_pytorch_lines_bits(dtype, k):
    gen = torch.Generator().manual_seed(k)
    slots = torch.randn(7, k, HIDDEN, generator=gen) * torch.logspace(-3, 3, HIDDEN)
    slots[0, 0] = 0.0  # a token's first slot from another rank: zero
    want = slots[:, 0]
    for j in range(1, k):
        want = want + slots[:, j]
    assert torch.equal(kernels.moe_sum_slots(slots, torch.empty(0, dtype=dtype)), want.to(dtype))
