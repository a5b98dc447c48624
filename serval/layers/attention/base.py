"""What every attention backend does, and what the runner and the model layers ask of it.

A backend owns three parts of a step's attention over the paged KV cache:
- ``build_metadata``: once per step, the tensors its kernels read, from the scheduled sequences (block ids and
  token counts: no requests);
- ``write_kv``: each layer's new keys and values into their cache slots;
- ``attend``: each layer's attention over the cache.
``selector.select_backend`` picks one backend at start-up; the metadata it builds carries it, so a model layer calls
``paged_attention(..., meta, ...)`` and never chooses a path itself.

Batch invariance, every backend's contract: a query's result must not depend on which other queries share the step,
how far its keys were padded, or whether it came in a prefill chunk or a decode, else greedy output changes with
batch composition, chunking and preemption (tests/layers/test_attention.py checks each backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step's flat token batch."""

    block_ids: list[int]  # its KV cache blocks, in order
    num_computed_tokens: int  # tokens already in the cache: the position of its first new token
    num_new_tokens: int  # its tokens in this step's batch

    @property
    def end(self) -> int:
        """Tokens of context once this step's are in the cache."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class AttentionMetadata:
    """What one step's flat batch tells attention, built once per step by the chosen backend; each backend's
    subclass adds the tensors its kernels read."""

    backend: AttentionBackend = field(repr=False, compare=False)  # the backend that built it, and runs it
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token


class AttentionBackend(ABC):
    """One way to run attention over the paged cache on one device."""

    # Whether a block table padded to a fixed width (build_metadata's table_width) costs nothing more: the kernel
    # reads each sequence's own blocks only. A backend that gathers every column says False.
    table_width_is_free: bool = True

    def __init__(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        self.device = torch.device(device)
        self.dtype = dtype  # the cache's: the model's dtype, or an 8-bit code dtype (kv_rows.py)
        self.block_size = block_size

    @abstractmethod
    def build_metadata(self, seqs: list[ScheduledSequence], table_width: int | None = None) -> AttentionMetadata:
        """The metadata of a flat batch holding ``seqs``' new tokens in order: one-token sequences (decodes) first,
        then the longer ones (prefill chunks, or a decode with speculative guesses). With ``table_width``, every
        block table (and every mask over its keys) is padded with block 0 to that many columns, so a decode-only
        batch of B sequences has the same tensor shapes at every step (what a CUDA graph's replay needs); the
        results are the same."""

    @abstractmethod
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Stores one layer's new keys and values k, v [T, KVH, D] at the flat slots ``slot_mapping`` of the caches
        [num_blocks, block_size, KVH, row]."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
               softcap: float | None = None) -> torch.Tensor:
        """Attention [T, H, D] of queries q [T, H, D] over the cache, which already holds this step's keys
        (k and v are the same new keys, for a backend that reads them directly); with ``softcap``, each scaled score
        s becomes softcap * tanh(s / softcap) before the softmax."""

    # Whether ``advance_decodes`` moves a decode-only batch's metadata on in place (multi-step decoding without a
    # host-built metadata per forward); a backend that says False has every forward's metadata built.
    advances_decodes: bool = False

    def advance_decodes(self, meta: AttentionMetadata, step: torch.Tensor) -> None:
        """Moves the metadata of a batch of one-token decodes one position on, in place and on the device, for the
        rows where ``step`` [S] (int64) is 1 (0: the row stays, e.g. a padding row): what build_metadata gives for
        the next positions, the block tables already holding the blocks of those positions."""
        raise NotImplementedError(f"{type(self).__name__} builds every forward's metadata")

    @staticmethod
    def _slots(block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
               ) -> torch.Tensor:
        """The flat cache slots of tokens at ``positions`` in the sequences ``rows`` of ``block_tables``, on the
        device (int64)."""
        positions = positions.long()
        return block_tables[rows.long(), positions // block_size].long() * block_size + positions % block_size

    def slot_mapping(self, seqs: list[ScheduledSequence]) -> torch.Tensor:
        """[T] the flat cache slot of each new token of ``seqs``."""
        bs = self.block_size
        return self._tensor([s.block_ids[p // bs] * bs + p % bs for s in seqs
                            for p in range(s.num_computed_tokens, s.end)])

    def _tensor(self, data: list) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    @staticmethod
    def _padded_tables(seqs: list[ScheduledSequence], table_width: int | None) -> list[list[int]]:
        """Each sequence's block ids padded with block 0 to ``table_width`` columns (None: the widest one's)."""
        width = max(len(s.block_ids) for s in seqs) if table_width is None else table_width
        if any(len(s.block_ids) > width for s in seqs):
            raise ValueError(f"a block table is wider than table_width={width}")
        return [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], or [.., KVH, D + 4] 8-bit rows
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # attend to each query's last ``window`` keys only (a sliding-window layer)
    softcap: float | None = None,  # scores soft-capped to (-softcap, softcap) by tanh (Gemma 2)
) -> torch.Tensor:
    """One layer's attention for a step: writes the new keys and values into the cache, then attends, by the backend
    that built ``meta``."""
    meta.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return meta.backend.attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
