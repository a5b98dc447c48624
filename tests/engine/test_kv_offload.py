"""The KV cache's second tier: the index's accounting with the KVCacheManager (ints only), and the BlockStore's copies
(host RAM and a disk file) on small tensors."""

from __future__ import annotations

import itertools

import pytest
import torch

from serval.engine.kv_cache import KVCacheManager
from serval.engine.kv_offload import BlockStore, BlockTransfers, OffloadIndex
from serval.engine.request import Request
from serval.sampling_params import SamplingParams

BLOCK = 4
_ids = itertools.count()


def make_request(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8), max_tokens=8)


def run_to_end(kv: KVCacheManager, request: Request) -> None:
    """Admits the request with its prefix hits, computes it whole, publishes its blocks and frees them."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    kv.free(request)
    kv.record_offload_hit(hits)


def test_evicted_cached_blocks_are_saved_and_found_again_in_the_second_tier():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, offload=OffloadIndex(8))
    a = make_request(list(range(9)))  # 2 full blocks and a partial one
    run_to_end(kv, a)
    a_blocks = {kv.pool.lookup(h, kv._block_key(a, i)) for i, h in enumerate(a.block_hashes[:2])}
    assert kv.take_transfers() is None  # nothing evicted yet: nothing to copy
    run_to_end(kv, make_request(list(range(100, 115))))  # 4 blocks: evicts every block of a
    transfers = kv.take_transfers()
    saved = {block for block, _, _ in transfers.saves}
    assert saved == a_blocks and not transfers.loads  # the full blocks only; the partial one was never cached
    assert all(entry is not None for _, _, entry in transfers.saves)

    again = make_request(list(range(9)) + [42])
    hits, num_hit = kv.get_computed_blocks(again)
    assert hits.device == [] and len(hits.offloaded) == 2 and num_hit == 8
    assert kv.allocate_slots(again, again.num_tokens - num_hit, hits)
    kv.record_offload_hit(hits)  # as the scheduler does at admission
    transfers = kv.take_transfers()
    # The loads fill the request's first blocks (saving what they evicted first), which are cached again at once.
    assert [(slot, block) for slot, block in transfers.loads] == list(zip(hits.offloaded, again.block_ids[:2]))
    assert again.num_cached_blocks == 2
    assert [kv.pool.lookup(h, kv._block_key(again, i)) for i, h in enumerate(again.block_hashes[:2])] == \
        again.block_ids[:2]
    assert kv.offload.stats.hit_tokens == 8 and kv.offload.stats.loaded_blocks == 2


def test_a_block_the_tier_already_holds_is_not_saved_twice():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, offload=OffloadIndex(8))
    for _ in range(3):  # evicted, loaded back, evicted again
        for tokens in (range(5), range(100, 116)):
            run_to_end(kv, make_request(list(tokens)))
            kv.take_transfers()  # the engine's step
    stats = kv.offload.stats
    # Each distinct block saved once (the tier has room for all, so none left it), though evicted every round.
    assert stats.saved_blocks == len(kv.offload.cached) >= 2
    assert stats.loaded_blocks > 2 and stats.hit_tokens > 2 * BLOCK  # the later rounds found them there


def test_the_tier_evicts_least_recently_used_but_never_a_slot_named_in_this_steps_transfers():
    index = OffloadIndex(2)
    index.save(0, 10, (0, (1,)))
    index.save(1, 11, (10, (2,)))
    index.take_transfers()
    assert index.lookup(10, (0, (1,))) is not None  # a hit: most recently used now, and busy until taken
    index.save(2, 12, (11, (3,)))  # evicts 11, the least recently used
    assert set(index.cached) == {10, 12}
    index.save(3, 13, (12, (4,)))  # the only slots are busy this step (10 looked up, 12 just saved): dropped
    assert set(index.cached) == {10, 12} and len(index.transfers.saves) == 1
    index.take_transfers()
    index.save(3, 13, (12, (4,)))
    assert set(index.cached) == {12, 13}
    assert index.lookup(10, (0, (1,))) is None
    assert index.lookup(13, (99, (4,))) is None  # the hash matches, the content does not: no hit


def test_swap_out_and_in_keeps_the_requests_progress_and_frees_its_slots_after_the_copy():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, offload=OffloadIndex(4))
    request = make_request(list(range(10)))
    assert kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    kv.cache_computed_blocks(request)
    blocks = list(request.block_ids)
    assert kv.swap_out(request)
    assert request.block_ids == [] and len(request.swapped_slots) == 3 and kv.pool.num_free_blocks == 6
    swapped = list(request.swapped_slots)
    out = kv.take_transfers()
    assert [(b, s) for b, s, entry in out.saves] == list(zip(blocks, swapped))
    assert all(entry is None for _, _, entry in out.saves)  # a swapped block is no prefix to keep
    assert kv.offload.num_swapped == 3 and len(kv.offload.free) == 1

    assert kv.allocate_slots(request, 1)  # resumes at token 10: its 3 blocks come back, the 11th token fits
    assert len(request.block_ids) == 3 and request.swapped_slots == []
    back = kv.take_transfers()
    assert back.loads == list(zip(swapped, request.block_ids))
    assert kv.offload.num_swapped == 0 and len(kv.offload.free) == 4


def test_swap_out_refuses_without_room_and_a_swapped_request_that_ends_frees_its_slots():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, offload=OffloadIndex(2))
    big = make_request(list(range(12)))
    assert kv.allocate_slots(big, 12)
    big.num_computed_tokens = 12
    assert not kv.swap_out(big)  # 3 blocks, 2 slots: nothing changed
    assert len(big.block_ids) == 3 and kv.take_transfers() is None
    small = make_request(list(range(50, 56)))
    assert kv.allocate_slots(small, 6)
    small.num_computed_tokens = 6
    assert kv.swap_out(small)
    kv.take_transfers()
    kv.free(small)  # aborted while swapped out
    assert kv.offload.num_swapped == 0 and len(kv.offload.free) == 2


def test_without_a_second_tier_nothing_is_swapped_or_copied():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    request = make_request(list(range(6)))
    assert kv.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    assert not kv.swap_out(request) and kv.take_transfers() is None
    assert [t["tier"] for t in kv.describe()["tiers"]] == ["cpu"]


def _cache(num_blocks: int = 4, dtype=torch.bfloat16) -> torch.Tensor:
    # [layer, k/v, block, slot, kv head, head dim]
    return torch.randn(3, 2, num_blocks, BLOCK, 2, 8).to(dtype)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # float8: no CPU index_copy_ of its own
@pytest.mark.parametrize("on_disk", [False, True], ids=["host", "disk"])
def test_the_store_copies_blocks_out_and_back_bit_for_bit(tmp_path, on_disk, dtype):
    kv_cache = _cache(dtype=dtype).view(torch.uint8)
    original = kv_cache.clone()
    store = BlockStore(4, kv_cache, tmp_path / "tier" if on_disk else None, {"model": "m"})
    store.execute(BlockTransfers(saves=[(1, 0, None), (3, 2, (77, (5, (1, 2, 3, 4))))]), kv_cache)
    kv_cache.zero_()
    kv_cache = kv_cache.view(dtype)
    # Saves run before loads: block 1 saved and overwritten in the same batch of copies.
    store.execute(BlockTransfers(saves=[(0, 3, None)], loads=[(2, 0), (0, 2)]), kv_cache)
    kv_cache = kv_cache.view(torch.uint8)
    assert torch.equal(kv_cache[:, :, 0], original[:, :, 3]) and torch.equal(kv_cache[:, :, 2], original[:, :, 1])
    assert store.entries() == ([(2, 77, (5, (1, 2, 3, 4)))] if on_disk else [])
    store.close()


def test_a_disk_tier_keeps_its_blocks_across_a_restart_for_the_same_model_only(tmp_path):
    kv_cache = _cache()
    store = BlockStore(4, kv_cache, tmp_path, {"model": "m"})
    store.execute(BlockTransfers(saves=[(2, 1, (123, (9, (1, 2, 3, 4))))]), kv_cache)
    with pytest.raises(ValueError, match="in use by another Serval process"):
        BlockStore(4, kv_cache, tmp_path, {"model": "m"})
    store.close()

    restarted = BlockStore(4, torch.zeros_like(kv_cache), tmp_path, {"model": "m"})
    assert restarted.entries() == [(1, 123, (9, (1, 2, 3, 4)))]
    fresh = torch.zeros_like(kv_cache)
    restarted.execute(BlockTransfers(loads=[(1, 0)]), fresh)
    assert torch.equal(fresh[:, :, 0], kv_cache[:, :, 2])
    restarted.close()

    other_model = BlockStore(4, kv_cache, tmp_path, {"model": "another"})
    assert other_model.entries() == []  # its files were started over
    other_model.close()
    index = OffloadIndex(4, [(1, 123, (9, (1, 2, 3, 4)))])
    assert index.lookup(123, (9, (1, 2, 3, 4))) == 1 and sorted(index.free) == [0, 2, 3]
