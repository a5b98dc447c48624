"""The weights the CPU kernels stream are in transparent huge pages (serval/layers/host_memory.py)."""

from __future__ import annotations

import mmap

import pytest
import torch
from test_block_quant_linear import random_blocks

from serval.layers import cpu_kernels
from serval.layers.host_memory import HUGE_PAGE, empty_in_huge_pages
from serval.layers.linear import BlockQuantLinear, Linear, lay_out_for_cpu_kernels


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                start, end = (int(part, 16) for part in first.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


needs_advice = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")


@needs_advice
def test_a_tensor_of_whole_huge_pages_and_a_tail_is_advised_only_over_the_whole_pages():
    """MADV_HUGEPAGE (smaps' "hg") from the first byte, 2 MiB-aligned, to the last whole 2 MiB; the tail stays in
    small pages, so no huge page holds bytes past the tensor's end. The tensor is an ordinary one."""
    tensor = empty_in_huge_pages((3 * HUGE_PAGE + 4096 * 5,), torch.uint8)
    tensor.fill_(7)
    start = tensor.data_ptr()
    assert start % HUGE_PAGE == 0
    assert "hg" in vm_flags(start) and "hg" in vm_flags(start + 3 * HUGE_PAGE - 1)
    assert "hg" not in vm_flags(start + 3 * HUGE_PAGE)
    assert int(tensor.sum()) == 7 * tensor.numel()
    assert empty_in_huge_pages((4, 16), torch.float16).shape == (4, 16)  # under 2 MiB: torch.empty


@needs_advice
def test_a_block_linears_panels_are_in_huge_pages():
    """The panels a BlockQuantLinear keeps (4.7 MB of Q4_K here) are in a mapping advised into huge pages."""
    if cpu_kernels.for_device(torch.device("cpu")) is None:
        pytest.skip("no CPU kernels here: the linear keeps the file's blocks")
    layer = BlockQuantLinear(random_blocks("Q4_K", 4096, 2048))
    assert layer.panels0.nbytes > HUGE_PAGE
    assert "hg" in vm_flags(layer.panels0.data_ptr())


@needs_advice
def test_a_dense_linears_weight_laid_out_for_the_kernel_is_in_huge_pages():
    """lay_out_for_cpu_kernels's W^T copy (4 MiB of bfloat16 here) is advised into huge pages, the same values."""
    if cpu_kernels.for_device(torch.device("cpu")) is None:
        pytest.skip("no CPU kernels here: the weight is not laid out")
    layer = Linear(2048, 1024)
    layer.weight.data = torch.randn(1024, 2048).bfloat16()
    before = layer.weight.detach().clone()
    assert lay_out_for_cpu_kernels(layer, bfloat16_linears=True) == 1
    assert torch.equal(layer.weight, before) and layer.weight.t().is_contiguous()
    assert "hg" in vm_flags(layer.weight.data_ptr())
