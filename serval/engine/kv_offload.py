"""The KV cache's second tier: blocks that left the first one (the KV cache tensor on the model's device).

Full blocks evicted from the first tier's prefix cache are written here under the same block hash and come back on
a prefix hit; requests preempted in swap mode park their blocks here until they run again. The tier lives in host
RAM (pinned when the KV cache is on a GPU) or in a memory-mapped file on disk, which keeps its blocks across a
restart: the hash chain (kv_cache.py) is the same in every process, and a header row per slot records which block
the slot holds.

Two owners, as for the first tier: ``OffloadIndex`` (ints only: which slot holds what, least recently used first)
belongs to the KVCacheManager, which lists the copies a step needs as ``BlockTransfers``; ``BlockStore`` (the
tensor) belongs to the runner, which makes the copies before the step's forward. Saves go first: a device block
saved in a step may be handed out again in the same step, as the destination of a load.
"""

from __future__ import annotations

import fcntl
import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's hash, the block's tokens): what a cached block holds
HEADER_COLUMNS = 3  # valid, block hash, parent hash; then the block's token ids


@dataclass
class BlockTransfers:
    """The copies between the tiers that must happen before the next forward, saves first."""

    saves: list[tuple[int, int, tuple[int, BlockKey] | None]] = field(default_factory=list)  # (block, slot, hash+key)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, block)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)

    @property
    def num_blocks(self) -> int:
        return len(self.saves) + len(self.loads)


@dataclass
class OffloadStats:
    saved_blocks: int = 0  # written to the tier (evicted cached blocks and swapped-out blocks)
    loaded_blocks: int = 0  # read back into the device cache (prefix hits and swap-ins)
    hit_tokens: int = 0  # prompt tokens of admitted requests found in this tier


class OffloadIndex:
    """Which slot of the second tier holds which block. Cached slots are evicted least recently used first;
    swapped slots belong to a preempted request until it resumes or ends."""

    def __init__(self, num_slots: int, entries: list[tuple[int, int, BlockKey]] = ()) -> None:
        """``entries``: (slot, block hash, key) of the blocks the store already holds (a disk tier's, at start)."""
        self.num_slots = num_slots
        self.cached: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.keys: dict[int, tuple[int, BlockKey]] = {}  # slot -> (hash, key) of each cached slot
        for slot, block_hash, key in entries:
            if block_hash not in self.cached:
                self.cached[block_hash] = slot
                self.keys[slot] = (block_hash, key)
        self.free = [slot for slot in reversed(range(num_slots)) if slot not in self.keys]
        self.num_swapped = 0
        self.stats = OffloadStats()
        self.transfers = BlockTransfers()
        self._busy: set[int] = set()  # slots named by the pending transfers or by a lookup of this step
        self._free_after_transfers: list[int] = []  # swap slots being loaded back

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """The slot holding this block, kept from eviction until the step's transfers are taken."""
        slot = self.cached.get(block_hash)
        if slot is None or self.keys[slot][1] != key:
            return None
        self.cached.move_to_end(block_hash)
        self._busy.add(slot)
        return slot

    def save(self, block_id: int, block_hash: int, key: BlockKey) -> None:
        """Keeps a cached device block that is being evicted (unless the tier has it already, or no room)."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self.cached[block_hash] = slot
        self.keys[slot] = (block_hash, key)
        self.transfers.saves.append((block_id, slot, (block_hash, key)))

    def load(self, slot: int, block_id: int) -> None:
        self._busy.add(slot)
        self.transfers.loads.append((slot, block_id))

    def swap_out(self, block_ids: list[int]) -> list[int] | None:
        """Slots for a preempted request's blocks, with their saves queued; None (nothing changed) without room."""
        available = len(self.free) + sum(1 for slot in self.cached.values() if slot not in self._busy)
        if len(block_ids) > available:
            return None
        slots = [self._take_slot() for _ in block_ids]
        self.transfers.saves += [(block_id, slot, None) for block_id, slot in zip(block_ids, slots)]
        self.num_swapped += len(slots)
        return slots

    def swap_in(self, slots: list[int], block_ids: list[int]) -> None:
        for slot, block_id in zip(slots, block_ids):
            self.load(slot, block_id)
        self._free_after_transfers += slots
        self.num_swapped -= len(slots)

    def drop_swapped(self, slots: list[int]) -> None:
        """A swapped-out request ended: its slots are free."""
        self.free += slots
        self.num_swapped -= len(slots)

    def take_transfers(self) -> BlockTransfers:
        """The pending copies, for the runner to make now; the slots they name are ordinary again."""
        transfers, self.transfers = self.transfers, BlockTransfers()
        self.stats.saved_blocks += len(transfers.saves)
        self.stats.loaded_blocks += len(transfers.loads)
        self._busy.clear()
        self.free += self._free_after_transfers
        self._free_after_transfers = []
        return transfers

    def describe(self) -> dict:
        return {"blocks": self.num_slots, "cached": len(self.cached), "swapped": self.num_swapped,
                "empty": len(self.free), "saved_blocks": self.stats.saved_blocks,
                "loaded_blocks": self.stats.loaded_blocks, "hit_tokens": self.stats.hit_tokens}

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used cached one that no pending transfer names."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((h for h, s in self.cached.items() if s not in self._busy), None)
            if victim is None:
                return None
            slot = self.cached.pop(victim)
            del self.keys[slot]
        self._busy.add(slot)
        return slot


class BlockStore:
    """The second tier's memory: one block of every layer's keys and values per slot, contiguous."""

    def __init__(self, num_slots: int, kv_cache: torch.Tensor, path: str | Path | None = None,
                 fingerprint: dict | None = None) -> None:
        """``kv_cache``: the first tier [layer, k/v, block, slot, kv head, head dim]. ``path``: a directory for
        a disk tier (files kept across restarts while ``fingerprint``, what the model and cache are, matches);
        None: host RAM."""
        # Bytes, whatever the cache's dtype (not every dtype has CPU copy kernels: float8 has no index_copy_).
        layers, _, _, block_size, kv_heads, row_bytes = kv_cache.view(torch.uint8).shape
        self.block_shape = (layers, 2, block_size, kv_heads, row_bytes)
        self.block_size = block_size
        self.num_slots = num_slots
        self.path = Path(path) if path is not None else None
        self.header: torch.Tensor | None = None  # [slot, HEADER_COLUMNS + block_size] int64, disk tier only
        if self.path is None:
            self.kind = "host"
            self.data = torch.empty((num_slots, *self.block_shape), dtype=torch.uint8,
                                    pin_memory=kv_cache.device.type == "cuda")
        else:
            self.kind = "disk"
            self._open(kv_cache.dtype, fingerprint or {})

    def _open(self, dtype: torch.dtype, fingerprint: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path / "lock", "w")  # noqa: SIM115 - held as long as the store lives
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"the KV offload directory {self.path} is in use by another Serval process") from None
        meta = {"format": 1, "fingerprint": fingerprint, "num_slots": self.num_slots,
                "block_shape": list(self.block_shape), "dtype": str(dtype)}
        meta_file, data_file, header_file = (self.path / name for name in ("meta.json", "blocks.bin", "index.bin"))
        try:
            same = json.loads(meta_file.read_text()) == meta
        except (OSError, ValueError):
            same = False
        if not same:  # another model, layout or size: what the files hold means nothing here
            for file in (meta_file, data_file, header_file):
                file.unlink(missing_ok=True)
        block_elements = math.prod(self.block_shape)
        header_columns = HEADER_COLUMNS + self.block_size
        for file, size in ((data_file, self.num_slots * block_elements),
                           (header_file, self.num_slots * header_columns * 8)):
            with open(file, "ab") as handle:  # sparse: the pages a slot never used take no disk
                handle.truncate(size)
        self.data = torch.from_file(str(data_file), shared=True, size=self.num_slots * block_elements,
                                    dtype=torch.uint8).view(self.num_slots, *self.block_shape)
        self.header = torch.from_file(str(header_file), shared=True, size=self.num_slots * header_columns,
                                      dtype=torch.int64).view(self.num_slots, header_columns)
        meta_file.write_text(json.dumps(meta))

    def entries(self) -> list[tuple[int, int, BlockKey]]:
        """(slot, block hash, key) of every block a disk tier holds from an earlier run."""
        if self.header is None:
            return []
        slots = torch.nonzero(self.header[:, 0] == 1).flatten().tolist()
        rows = self.header[slots].tolist()
        return [(slot, row[1], (row[2], tuple(row[HEADER_COLUMNS:]))) for slot, row in zip(slots, rows)]

    def execute(self, transfers: BlockTransfers, kv_cache: torch.Tensor) -> None:
        """Makes the copies: saves (device -> tier), then loads (tier -> device)."""
        kv_cache = kv_cache.view(torch.uint8)
        if transfers.saves:
            slots = torch.tensor([slot for _, slot, _ in transfers.saves])
            block_ids = torch.tensor([block for block, _, _ in transfers.saves], device=kv_cache.device)
            if self.header is not None:
                self.header[slots, 0] = 0  # a slot is marked valid only once its data is whole
            blocks = kv_cache.index_select(2, block_ids).permute(2, 0, 1, 3, 4, 5)
            self.data.index_copy_(0, slots, blocks.to(self.data.device))
            if self.header is not None:
                rows = [(slot, [1, entry[0], entry[1][0], *entry[1][1]])
                        for _, slot, entry in transfers.saves if entry is not None]
                if rows:
                    self.header[torch.tensor([slot for slot, _ in rows])] = torch.tensor([row for _, row in rows])
        if transfers.loads:
            slots = torch.tensor([slot for slot, _ in transfers.loads])
            block_ids = torch.tensor([block for _, block in transfers.loads], device=kv_cache.device)
            blocks = self.data.index_select(0, slots).to(kv_cache.device, non_blocking=True)
            kv_cache.index_copy_(2, block_ids, blocks.permute(1, 2, 0, 3, 4, 5))

    def close(self) -> None:
        """Lets the files go (a disk tier's blocks stay in them for the next run)."""
        if self.path is not None and not self._lock.closed:
            self.data = self.header = None
            self._lock.close()
