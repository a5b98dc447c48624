"""Host memory for the weights the CPU kernels stream: anonymous private maps in transparent huge pages.

A decode step reads every weight once, and in 4 KiB pages each 4 KiB of it is a TLB miss (the page-table walks
then take a share of the memory's bandwidth); in 2 MiB pages there are 512 times fewer. Measured on an AMD EPYC
Zen 4, 2 threads, one row out of cache: Q4_K and Q6_K panels at 24-31 GB/s in small pages, 31-35 GB/s in huge ones
(benchmarks/README.md, "Then: where a row's time goes, four pairs of codes a permutation, and the weights in huge
pages").
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page


def empty_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, in 2 MiB pages where the OS gives them (transparent huge pages
    set to ``madvise`` or ``always``): a private anonymous map, its start 2 MiB-aligned, with MADV_HUGEPAGE over its
    whole 2 MiB runs. The part past the last whole run stays in small pages, so no page is held beyond the tensor's
    bytes (a map is shared, and never in huge pages, unless it is private: Python's mmap defaults to shared). A tensor
    under 2 MiB, or an OS without the advice, gets torch.empty."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # (the tensor keeps the map alive)
    start = -whole.data_ptr() % HUGE_PAGE
    memory.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start: start + nbytes].view(dtype).view(shape)
