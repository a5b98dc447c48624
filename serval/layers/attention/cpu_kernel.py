"""Attention by the C++ CPU kernel (``csrc/paged_attention.cpp``): every token of a step in one call, each query on
its own over its own prefix of the cache, read in place, so its result never depends on its batch-mates.

The metadata is per token: every scheduled sequence's block table, each token's row in it, and how many keys each
token attends to. A decode and a prefill chunk are the same thing to it.

A layer that soft-caps its scores (Gemma 2's attention logit soft-capping) passes the cap to the kernel, which caps
every query's scores by the same code, so a query's result still never depends on its batch-mates or on chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from serval.layers import cpu_kernels
from serval.layers.attention.base import AttentionBackend, AttentionMetadata, ScheduledSequence
from serval.layers.attention.kv_rows import is_quantized, write_kv


@dataclass
class CpuKernelMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # [S, max_blocks] every scheduled sequence's block ids, padded with block 0
    token_table: torch.Tensor  # [T] each token's row in block_tables
    context_lens: torch.Tensor  # [T] how many keys each token attends to: its position + 1


class CpuKernelBackend(AttentionBackend):
    def __init__(self, device: torch.device | str, dtype: torch.dtype, block_size: int, kernels: ModuleType) -> None:
        super().__init__(device, dtype, block_size)
        self.kernels = kernels

    def __reduce__(self):
        # A step's metadata crosses to the other model-parallel ranks pickled, its backend with it; a module does
        # not pickle, so the receiving rank builds the backend again around its own loaded kernels.
        return _with_loaded_kernels, (self.device, self.dtype, self.block_size)

    def build_metadata(self, seqs: list[ScheduledSequence], table_width: int | None = None) -> CpuKernelMetadata:
        positions = [p for s in seqs for p in range(s.num_computed_tokens, s.end)]
        return CpuKernelMetadata(
            self, self.slot_mapping(seqs), block_tables=self._tensor(self._padded_tables(seqs, table_width)),
            token_table=self._tensor([row for row, s in enumerate(seqs) for _ in range(s.num_new_tokens)]),
            context_lens=self._tensor(positions) + 1)

    advances_decodes = True

    def advance_decodes(self, meta: CpuKernelMetadata, step: torch.Tensor) -> None:
        meta.context_lens.add_(step)
        meta.slot_mapping.copy_(self._slots(meta.block_tables, meta.token_table, meta.context_lens - 1,
                                            self.block_size))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        head_dim = k.shape[-1]
        if is_quantized(k_cache):
            self.kernels.quantize_kv_(k.contiguous(), k_cache, slot_mapping)
            self.kernels.quantize_kv_(v.contiguous(), v_cache, slot_mapping)
        elif k.stride(-1) == 1 and k.stride(-2) == head_dim and v.stride(-1) == 1 and v.stride(-2) == head_dim:
            self.kernels.write_kv_(k_cache, v_cache, k, v, slot_mapping)  # both in one call, from q/k/v's views
        else:
            write_kv(k_cache, k, slot_mapping)
            write_kv(v_cache, v, slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: CpuKernelMetadata, scale: float, window: int | None,
               softcap: float | None = None) -> torch.Tensor:
        return self.kernels.paged_attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.token_table,
                                            meta.context_lens, scale, window or 0, softcap or 0.0)


def _with_loaded_kernels(device: torch.device, dtype: torch.dtype, block_size: int) -> CpuKernelBackend:
    kernels = cpu_kernels.for_device(device)
    if kernels is None:
        raise RuntimeError("rank 0 runs attention with the C++ CPU kernels, which this rank cannot load")
    return CpuKernelBackend(device, dtype, block_size, kernels)
