"""Accounting for the paged KV cache: which block holds whose tokens. Ints only; the tensor lives in the runner.

Every block is free (ref_count 0, maybe still holding a cached prefix) or owned (ref_count >= 1).
Freed blocks keep their contents and their hash, and are evicted least recently used first.

Conversation sessions: when a request that carries a session id finishes, its full blocks (prompt and generated
tokens, already in the prefix cache) stay owned by the session (one reference each) until its TTL runs out, the
session is ended, a newer turn of it replaces them, or the room is needed: sessions hold at most a share of the
blocks and are given up least recently used first before any request waits or is preempted. The next turn finds
them by the ordinary prefix lookup. A given-up session's blocks become free cached blocks: the next turn may still
hit them, or recomputes.

A second tier (kv_offload.py), when configured, keeps the cached blocks the first one evicts, finds them by the
same hash when the prefix lookup runs past the first tier's hits, and parks the blocks of requests preempted in
swap mode. The copies are listed as BlockTransfers, which the engine hands to the runner before each forward.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from serval.engine.kv_offload import BlockTransfers, OffloadIndex
from serval.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # What the cached block holds (the parent block's hash and its own tokens), to verify a hash hit exactly.
    key: tuple[int, tuple[int, ...]] | None = None


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int, int, tuple], None] | None = None) -> None:
        """``on_evict(block_id, block_hash, key)``: called for a cached block about to be reused."""
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.on_evict = on_evict
        # Free blocks in eviction order (oldest first); a dict gives O(1) removal from the middle on a cache hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        assert count <= len(self.free_queue), "caller checks capacity first"
        ids = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached prefix
                if self.on_evict is not None:
                    self.on_evict(block_id, block.block_hash, block.key)
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = block.key = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Takes a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        # Reverse order: a sequence's last blocks are the least likely to be shared, so they are evicted first.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: int, key: tuple[int, tuple[int, ...]]) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].key != key:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: int, key: tuple[int, tuple[int, ...]]) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash, block.key = block_hash, key
        self.cached.setdefault(block_hash, block_id)

    def num_owned_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 0)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    session_requests: int = 0  # admitted requests that named a session the cache held
    session_hit_tokens: int = 0  # prompt tokens those requests found cached (computed in an earlier turn)


@dataclass
class ComputedBlocks:
    """A request's longest cached prefix: blocks of the device cache, then slots of the second tier after them."""

    device: list[int] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.device) + len(self.offloaded)


@dataclass
class Session:
    block_ids: list[int]  # full blocks of the conversation so far, one reference each
    expires_at: float  # time.monotonic()


class KVCacheManager:
    """Gives requests the blocks they need, shares cached prefixes, takes blocks back."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 session_ttl: float = 600.0, session_cache_fraction: float = 0.5,
                 offload: OffloadIndex | None = None) -> None:
        """``offload``: the second tier's index (None: one tier)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload
        self.pool = BlockPool(num_blocks, offload.save if offload is not None and enable_prefix_caching else None)
        self.stats = PrefixCacheStats()
        self.session_ttl = session_ttl
        self.max_session_blocks = int(num_blocks * session_cache_fraction)
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.num_session_blocks = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """The blocks of the request's longest cached prefix (on the device, then in the second tier), and how many
        tokens they hold.

        At least one token is always left to compute, since the last one's logits are needed. A request that asks
        for prompt logprobs gets no hit: it needs the logits of every prompt position, which the cache does not keep
        (as in vLLM v1). Its own blocks are still published for others."""
        hits = ComputedBlocks()
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return hits, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_hashes(request, max_blocks)
        for i in range(max_blocks):
            block_id = self.pool.lookup(request.block_hashes[i], self._block_key(request, i))
            if block_id is None:
                break
            hits.device.append(block_id)
        if self.offload is not None:
            for i in range(len(hits.device), max_blocks):
                slot = self.offload.lookup(request.block_hashes[i], self._block_key(request, i))
                if slot is None:
                    break
                hits.offloaded.append(slot)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Counts one admitted request's prefix lookup (not the lookups of attempts that had to wait)."""
        if self.enable_prefix_caching:
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += num_hit_tokens
            if request.session_id is not None and request.session_id in self.sessions:
                self.stats.session_requests += 1
                self.stats.session_hit_tokens += num_hit_tokens

    def record_offload_hit(self, computed: ComputedBlocks) -> None:
        if computed.offloaded:
            self.offload.stats.hit_tokens += len(computed.offloaded) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None,
                       may_end_sessions: bool = True) -> bool:
        """Makes room for ``num_new_tokens`` more tokens of KV after the request's computed tokens and the cached
        prefix ``computed`` it takes (at admission), and queues the loads of what the second tier holds of it (the
        prefix's offloaded blocks, or a swapped-out request's own). False (nothing changed) when blocks run out
        (``may_end_sessions`` False: when the free blocks alone are too few, kept conversations stay)."""
        if computed is None and not request.swapped_slots and -(
                -(request.num_computed_tokens + num_new_tokens) // self.block_size) <= len(request.block_ids):
            return True  # a running request's tokens fit its blocks (most decodes): the general path would agree
        computed = computed or ComputedBlocks()
        num_total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = -(-num_total // self.block_size) - len(request.block_ids) - len(computed.device)
        while True:
            # Cached blocks that are free now stop being free once the request takes them.
            reclaimed = sum(1 for b in computed.device if self.pool.blocks[b].ref_count == 0)
            if needed <= self.pool.num_free_blocks - reclaimed:
                break
            # Kept conversations yield before running requests do.
            if not may_end_sessions or not self._give_up_session(keep=request.session_id):
                return False
        first_new = len(request.block_ids) + len(computed.device)
        if computed.device:
            self.pool.touch(computed.device)
            request.block_ids.extend(computed.device)
        if needed > 0:
            new_blocks = self.pool.allocate(needed)
            request.block_ids.extend(new_blocks)
            # The first new blocks take what the second tier holds: the prefix found there, published again as
            # cached device blocks, or a swapped-out request's blocks.
            for i, (slot, block_id) in enumerate(zip(computed.offloaded, new_blocks)):
                self.offload.load(slot, block_id)
                self.pool.cache(block_id, request.block_hashes[first_new + i], self._block_key(request, first_new + i))
            if request.swapped_slots:
                self.offload.swap_in(request.swapped_slots, new_blocks)
                request.swapped_slots = []
        if computed:
            request.num_cached_blocks = first_new + len(computed.offloaded)
        return True

    def swap_out(self, request: Request) -> bool:
        """Parks a preempted request's computed KV in the second tier and frees its device blocks, so that it
        resumes where it stopped. False (nothing changed) when there is no second tier or no room in it."""
        if self.offload is None:
            return False
        count = -(-request.num_computed_tokens // self.block_size)
        slots = self.offload.swap_out(request.block_ids[:count])
        if slots is None:
            return False
        self.free(request)
        request.swapped_slots = slots
        return True

    def take_transfers(self) -> BlockTransfers | None:
        """The copies between the tiers to make before the next forward (None when there are none)."""
        if self.offload is None or not self.offload.transfers:
            return None
        return self.offload.take_transfers()

    def offload_cached_blocks(self) -> None:
        """Saves every cached device block the second tier lacks, least recently used first (at shutdown: a disk
        tier then holds the whole prefix cache for the next run)."""
        if self.offload is None or not self.enable_prefix_caching:
            return
        order = list(self.pool.free_queue) + [b.block_id for b in self.pool.blocks if b.ref_count > 0]
        for block_id in order:
            block = self.pool.blocks[block_id]
            if block.block_hash is not None:
                self.offload.save(block_id, block.block_hash, block.key)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publishes the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        self._update_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i], self._block_key(request, i))
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def trim(self, request: Request) -> None:
        """Gives back blocks past the ones the request's tokens need (slots taken for speculative guesses that were
        rejected). They hold no computed token, so none of them is in the prefix cache."""
        needed = -(-request.num_tokens // self.block_size)
        if len(request.block_ids) > needed:
            self.pool.release(request.block_ids[needed:])
            del request.block_ids[needed:]

    def free(self, request: Request) -> None:
        if request.swapped_slots:  # it ended while swapped out
            self.offload.drop_swapped(request.swapped_slots)
            request.swapped_slots = []
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0

    def describe(self, device: str = "cpu", offload_kind: str = "host") -> dict:
        """What the cache holds now, for GET /debug/kv: blocks by state in each tier, the prefix cache's and the
        sessions' use."""
        pool, stats = self.pool, self.stats
        free = pool.num_free_blocks
        cached_free = sum(1 for b in pool.free_queue if pool.blocks[b].block_hash is not None)
        now = time.monotonic()
        tiers = [{"tier": device, "blocks": self.num_blocks, "owned": self.num_blocks - free,
                       # distinct blocks (conversations that share a system prompt share its blocks)
                       "owned_by_sessions": len({b for s in self.sessions.values() for b in s.block_ids}),
                       "cached_free": cached_free,
                       "empty": free - cached_free}]
        if self.offload is not None:
            tiers.append({"tier": offload_kind, **self.offload.describe()})
        return {
            "block_size": self.block_size,
            "tiers": tiers,
            "prefix_cache": {"enabled": self.enable_prefix_caching, "queried_tokens": stats.queried_tokens,
                             "hit_tokens": stats.hit_tokens,
                             "hit_rate": stats.hit_tokens / stats.queried_tokens if stats.queried_tokens else 0.0},
            # blocks: the sessions' references, what the cap counts
            "sessions": {"count": len(self.sessions), "blocks": self.num_session_blocks,
                         "max_blocks": self.max_session_blocks, "ttl_s": self.session_ttl,
                         "requests": stats.session_requests, "hit_tokens": stats.session_hit_tokens,
                         "kept": [{"session_id": session_id, "blocks": len(s.block_ids),
                                   "tokens": len(s.block_ids) * self.block_size,
                                   "expires_in_s": round(s.expires_at - now, 1)}
                                  for session_id, s in reversed(self.sessions.items())]},  # most recent first
        }

    # -- conversation sessions -------------------------------------------------------------------------------------
    def pin_session(self, session_id: str, request: Request) -> None:
        """Keeps the finished request's full cached blocks for its session's next turn (replacing the last turn's).
        Call before ``free(request)``."""
        self.end_session(session_id)
        blocks = request.block_ids[: request.num_cached_blocks]
        if not self.enable_prefix_caching or not blocks or len(blocks) > self.max_session_blocks:
            return
        self.pool.touch(blocks)
        self.sessions[session_id] = Session(list(blocks), time.monotonic() + self.session_ttl)
        self.num_session_blocks += len(blocks)
        while self.num_session_blocks > self.max_session_blocks:
            self._give_up_session(keep=session_id)

    def end_session(self, session_id: str) -> bool:
        """Releases a session's blocks (they stay in the prefix cache while free). False: no such session."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self.num_session_blocks -= len(session.block_ids)
        self.pool.release(session.block_ids)
        return True

    def expire_sessions(self, now: float | None = None) -> None:
        """Ends the sessions whose TTL ran out (oldest first: a pin renews its session's place and TTL)."""
        now = time.monotonic() if now is None else now
        while self.sessions:
            session_id, session = next(iter(self.sessions.items()))
            if session.expires_at > now:
                break
            self.end_session(session_id)

    def _give_up_session(self, keep: str | None = None) -> bool:
        """Ends the least recently used session (``keep`` last of all). False when there is none."""
        victim = next((s for s in self.sessions if s != keep), None)
        if victim is None and keep in self.sessions:
            victim = keep
        return victim is not None and self.end_session(victim)

    def _block_key(self, request: Request, i: int) -> tuple[int, tuple[int, ...]]:
        parent = request.block_hashes[i - 1] if i else 0
        return parent, tuple(request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size))

    def _update_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
            # A strong hash of the chain: Python's hash() of ints collides by construction (2**61 - 1 ≡ 0).
            digest = hashlib.blake2b(array("q", [parent, *tokens]).tobytes(), digest_size=8).digest()
            hashes.append(int.from_bytes(digest, "little", signed=True))
