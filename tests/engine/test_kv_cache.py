"""KVCacheManager and BlockPool: block accounting, prefix caching and eviction, with ints only."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from serval.engine.kv_cache import KVCacheManager
from serval.engine.request import Request
from serval.sampling_params import SamplingParams

BLOCK = 4
_ids = itertools.count()


def make_request(tokens: list[int], request_id: str | None = None) -> Request:
    rid = request_id or f"r{next(_ids)}"
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), max_tokens=8)


def assert_pool_consistent(kv: KVCacheManager, live: list[Request] | None = None) -> None:
    """Every block is free (in the free queue, ref_count 0) or owned (ref_count >= 1), never both.

    With ``live`` (every request holding blocks), each block's ref_count is exactly how many of them (and of the
    conversation sessions) hold it."""
    pool = kv.pool
    assert len(pool.free_queue) == pool.num_free_blocks
    assert set(pool.free_queue) <= set(range(kv.num_blocks))
    for block in pool.blocks:
        assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
        assert (block.block_id in pool.free_queue) == (block.ref_count == 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, in free queue: {block.block_id in pool.free_queue}")
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash
    if live is not None:
        holders = Counter(b for r in live for b in r.block_ids)
        holders.update(b for s in kv.sessions.values() for b in s.block_ids)
        assert kv.num_session_blocks == sum(len(s.block_ids) for s in kv.sessions.values()) <= kv.max_session_blocks
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id}"
        for r in live:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} holds a block twice"


def device_hits(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    hits, num_hit = kv.get_computed_blocks(request)
    assert not hits.offloaded  # one tier here
    return hits.device, num_hit


def compute_and_publish(kv: KVCacheManager, request: Request) -> None:
    """What a request's life up to a full prefill looks like: look up, allocate, compute, publish."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    kv.record_prefix_query(request, num_hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


# -- allocation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4)])
def test_allocate_slots_gives_ceil_tokens_over_block_size_blocks(num_tokens, num_blocks):
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request(list(range(num_tokens)))
    assert kv.allocate_slots(request, num_tokens)
    assert len(request.block_ids) == num_blocks
    assert kv.pool.num_free_blocks == 8 - num_blocks
    assert_pool_consistent(kv, [request])


def test_allocate_slots_grows_a_request_only_when_a_block_fills():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request([1, 2, 3])
    assert kv.allocate_slots(request, 3)
    first = list(request.block_ids)
    request.num_computed_tokens = 3
    request.output_token_ids.append(10)
    assert kv.allocate_slots(request, 1)  # the 4th token still fits in block 0
    assert request.block_ids == first
    request.num_computed_tokens = 4
    request.output_token_ids.append(11)
    assert kv.allocate_slots(request, 1)  # the 5th does not
    assert request.block_ids[:1] == first and len(request.block_ids) == 2
    assert_pool_consistent(kv, [request])


def test_allocate_slots_fails_without_changing_anything_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a, b = make_request(list(range(12))), make_request(list(range(100, 108)))
    assert kv.allocate_slots(a, 12)
    assert not kv.allocate_slots(b, 8)  # needs 2, 1 is free
    assert b.block_ids == []
    assert kv.pool.num_free_blocks == 1
    assert_pool_consistent(kv, [a])
    assert kv.allocate_slots(b, 4)  # one block still fits
    assert len(b.block_ids) == 1 and kv.pool.num_free_blocks == 0
    assert_pool_consistent(kv, [a, b])


def test_free_returns_every_block_and_usage_drops_to_zero():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK)
    a, b = make_request(list(range(10))), make_request(list(range(50, 57)))
    assert kv.allocate_slots(a, 10) and kv.allocate_slots(b, 7)
    assert kv.usage == pytest.approx(5 / 6)
    kv.free(a)
    assert a.block_ids == [] and kv.pool.num_free_blocks == 4
    assert_pool_consistent(kv, [b])
    kv.free(b)
    assert kv.usage == 0.0 and kv.pool.num_owned_blocks() == 0
    assert_pool_consistent(kv, [])


# -- prefix caching ---------------------------------------------------------------------------------------------


def test_shared_prefix_hits_the_published_blocks_and_shares_them():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    a = make_request(list(range(12)))  # 3 full blocks
    compute_and_publish(kv, a)
    b = make_request(list(range(8)) + [90, 91, 92, 93])  # same first 2 blocks, different 3rd
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits.device == a.block_ids[:2] and num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert [kv.pool.blocks[i].ref_count for i in a.block_ids] == [2, 2, 1]
    assert_pool_consistent(kv, [a, b])
    # B's own third block is published on top of the shared prefix, and a third request finds all of it.
    b.num_computed_tokens = b.num_tokens
    kv.cache_computed_blocks(b)
    c = make_request(b.prompt_token_ids + [7])
    hits, num_hit = kv.get_computed_blocks(c)
    assert hits.device == b.block_ids and num_hit == 12


def test_a_different_first_block_gets_no_hit_even_if_later_blocks_match():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    compute_and_publish(kv, make_request(list(range(12))))
    other = make_request([99, 1, 2, 3] + list(range(4, 12)) + [0])
    assert kv.get_computed_blocks(other)[1] == 0 and not kv.get_computed_blocks(other)[0]


@pytest.mark.parametrize("prompt_len, expected_hit_blocks", [(8, 1), (9, 2), (12, 2), (13, 3)])
def test_the_last_token_is_never_served_from_the_cache(prompt_len, expected_hit_blocks):
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    compute_and_publish(kv, make_request(list(range(16))))  # everything below is cached
    hits, num_hit = kv.get_computed_blocks(make_request(list(range(prompt_len))))
    assert len(hits) == expected_hit_blocks and num_hit == expected_hit_blocks * BLOCK
    assert num_hit < prompt_len


def test_a_hash_hit_with_different_tokens_is_rejected():
    a = make_request([0, 1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request([99, 1, 2, 3, 4, 5, 6, 7, 8])
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    compute_and_publish(kv, a)
    b.block_hashes = list(a.block_hashes[:2])  # as if the hash chains collided
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits.device == [] and num_hit == 0


def test_python_hash_aliases_do_not_collide():
    # Python hashes ints modulo 2**61 - 1; the block hash must not inherit that.
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    a, b = make_request([0, 1, 2, 3, 4]), make_request([2**61 - 1, 1, 2, 3, 4])
    kv.get_computed_blocks(a)
    kv.get_computed_blocks(b)
    assert a.block_hashes[0] != b.block_hashes[0]


def test_a_hit_is_never_served_from_a_block_computed_after_a_different_prefix():
    alias = 2**61 - 1  # hash(alias) == hash(0)
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    x = make_request([0, 1, 2, 3, 9])  # publishes only block (0, 1, 2, 3)
    compute_and_publish(kv, x)
    y = make_request([alias, 1, 2, 3, 4, 5, 6, 7, 8])  # block 0 collides with x's, block 1 is (4, 5, 6, 7)
    compute_and_publish(kv, y)
    z = make_request([0, 1, 2, 3, 4, 5, 6, 7, 8])
    hits, _ = kv.get_computed_blocks(z)
    # x's block 0 is right for z; y's block 1 holds KV of (4..7) computed after (alias, 1, 2, 3), wrong for z.
    assert hits.device == x.block_ids[:1]


def test_freed_blocks_stay_cached_and_are_reused():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = make_request(list(range(12)))
    compute_and_publish(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    assert kv.pool.num_free_blocks == 8
    b = make_request(list(range(12)) + [5])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits.device == a_blocks and num_hit == 12
    assert kv.allocate_slots(b, 1, hits)
    assert b.block_ids[:3] == a_blocks
    assert [kv.pool.blocks[i].ref_count for i in a_blocks] == [1, 1, 1]
    assert kv.pool.num_free_blocks == 8 - 4
    assert_pool_consistent(kv, [b])


def test_free_cached_hit_blocks_count_against_capacity():
    # 3 blocks, all cached and free: a hit on 2 of them leaves room for exactly 1 new block.
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    a = make_request(list(range(12)))
    compute_and_publish(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    too_big = make_request(list(range(8)) + list(range(50, 58)))  # needs 2 new blocks
    hits, num_hit = kv.get_computed_blocks(too_big)
    assert len(hits) == 2
    assert not kv.allocate_slots(too_big, too_big.num_tokens - num_hit, hits)
    assert too_big.block_ids == [] and kv.pool.num_free_blocks == 3
    assert all(kv.pool.blocks[i].ref_count == 0 for i in hits.device)
    assert_pool_consistent(kv, [])
    fits = make_request(list(range(8)) + [50, 51, 52, 53])
    hits, num_hit = kv.get_computed_blocks(fits)
    assert kv.allocate_slots(fits, fits.num_tokens - num_hit, hits)
    # The new block is the one not hit (a's evicted third), never one of the hit blocks.
    assert fits.block_ids == a_blocks
    assert_pool_consistent(kv, [fits])


def test_eviction_is_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_request([1, 1, 1, 1, 0])
    b = make_request([2, 2, 2, 2, 0])
    compute_and_publish(kv, a)  # 2 blocks: one full (cached), one partial
    compute_and_publish(kv, b)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)
    kv.free(b)  # b freed last: its blocks are the most recently used
    filler = make_request(list(range(100, 108)))  # needs 2 blocks: evicts a's
    assert kv.allocate_slots(filler, 8)
    assert sorted(filler.block_ids) == sorted(a_blocks)
    assert device_hits(kv, make_request([1, 1, 1, 1, 5])) == ([], 0)
    assert device_hits(kv, make_request([2, 2, 2, 2, 5])) == (b_blocks[:1], 4)
    assert_pool_consistent(kv, [filler])


def test_a_freed_requests_tail_is_evicted_before_its_head():
    # Later blocks are the least likely to be shared, so a freed prefix survives eviction longest.
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    a = make_request(list(range(12)))
    compute_and_publish(kv, a)
    kv.free(a)
    assert kv.allocate_slots(make_request([50, 51, 52, 53]), 4)  # evicts exactly one block
    assert kv.get_computed_blocks(make_request(list(range(12)) + [7]))[1] == 8


def test_a_hit_refreshes_a_block_so_it_outlives_older_ones():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_request([1, 1, 1, 1, 0])
    b = make_request([2, 2, 2, 2, 0])
    compute_and_publish(kv, a)
    compute_and_publish(kv, b)
    kv.free(a)
    kv.free(b)
    again = make_request([1, 1, 1, 1, 7])  # reuses a's block, then frees it: now b's is older
    compute_and_publish(kv, again)
    kv.free(again)
    filler = make_request(list(range(100, 108)))
    assert kv.allocate_slots(filler, 8)
    assert kv.get_computed_blocks(make_request([2, 2, 2, 2, 5]))[1] == 0
    assert kv.get_computed_blocks(make_request([1, 1, 1, 1, 5]))[1] == 4
    assert_pool_consistent(kv, [filler])


def test_prefix_cache_stats_count_queried_and_hit_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    compute_and_publish(kv, make_request(list(range(12))))
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (12, 0)
    compute_and_publish(kv, make_request(list(range(8)) + [50, 51, 52]))  # 11 tokens, 2 blocks hit
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (23, 8)
    kv.get_computed_blocks(make_request(list(range(12))))  # a lookup alone (a request that must wait) counts nothing
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (23, 8)
    compute_and_publish(kv, make_request([70, 71, 72, 73, 74]))  # 5 tokens, no hit
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (28, 8)


def test_with_prefix_caching_disabled_nothing_is_ever_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    a = make_request(list(range(12)))
    compute_and_publish(kv, a)
    assert kv.pool.cached == {}
    b = make_request(list(range(12)) + [1])
    assert device_hits(kv, b) == ([], 0)
    kv.free(a)
    assert device_hits(kv, b) == ([], 0)
    assert kv.stats.hit_tokens == 0


# -- invariants under random use ---------------------------------------------------------------------------------


def test_pool_stays_consistent_under_random_allocate_grow_and_free():
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK)
    # A few shared prefixes so that hits, sharing and eviction all happen.
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(4, 13))] for _ in range(4)]
    live: list[Request] = []
    num_hits = num_refused = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.4:  # a new request: prefix lookup, then allocate the rest
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            request = make_request(tokens)
            hits, num_hit = kv.get_computed_blocks(request)
            free_before = kv.pool.num_free_blocks
            if kv.allocate_slots(request, request.num_tokens - num_hit, hits):
                num_hits += bool(hits)
                request.num_computed_tokens = request.num_tokens
                kv.cache_computed_blocks(request)
                live.append(request)
                # What it holds is what it says: every hit block holds this request's tokens.
                for i, block_id in enumerate(request.block_ids[:request.num_cached_blocks]):
                    expected = tuple(request.all_token_ids[i * BLOCK:(i + 1) * BLOCK])
                    assert kv.pool.blocks[block_id].key[1] == expected
            else:
                num_refused += 1
                assert request.block_ids == [] and kv.pool.num_free_blocks == free_before
        elif op < 0.7 and live:  # a decode step of a live request
            request = rng.choice(live)
            request.output_token_ids.append(rng.randrange(5))
            if kv.allocate_slots(request, 1):
                request.num_computed_tokens += 1
                kv.cache_computed_blocks(request)
            else:
                request.output_token_ids.pop()
        elif live:
            kv.free(live.pop(rng.randrange(len(live))))
        assert_pool_consistent(kv, live)
    assert num_hits > 10 and num_refused > 10  # the sequence exercised both paths
    for request in live:
        kv.free(request)
    assert kv.pool.num_owned_blocks() == 0
    assert_pool_consistent(kv, [])


# -- conversation sessions ----------------------------------------------------------------------------------------

def finish_turn(kv: KVCacheManager, request: Request, session_id: str) -> None:
    """A turn that ends normally: its full blocks are pinned for the session, then the request lets go."""
    request.session_id = session_id
    kv.pin_session(session_id, request)
    kv.free(request)


def test_a_session_keeps_its_blocks_through_traffic_that_cycles_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    turn = make_request(range(100, 113))  # 13 tokens: 3 full blocks cached, 1 partial
    compute_and_publish(kv, turn)
    finish_turn(kv, turn, "conv")
    assert kv.num_session_blocks == 3 and kv.pool.num_free_blocks == 5
    for i in range(6):  # every free block reused, several times over
        other = make_request(range(i * 1000, i * 1000 + 20))
        compute_and_publish(kv, other)
        kv.free(other)
        assert_pool_consistent(kv, [])
    next_turn = make_request([*range(100, 113), 7, 8, 9, 10])
    next_turn.session_id = "conv"
    hits, num_hit = kv.get_computed_blocks(next_turn)
    assert num_hit == 12 and kv.allocate_slots(next_turn, next_turn.num_tokens - num_hit, hits)
    kv.record_prefix_query(next_turn, num_hit)
    assert (kv.stats.session_requests, kv.stats.session_hit_tokens) == (1, 12)
    assert_pool_consistent(kv, [next_turn])


def test_without_a_session_the_same_traffic_evicts_the_conversation():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    turn = make_request(range(100, 113))
    compute_and_publish(kv, turn)
    kv.free(turn)
    for i in range(6):
        other = make_request(range(i * 1000, i * 1000 + 20))
        compute_and_publish(kv, other)
        kv.free(other)
    assert kv.get_computed_blocks(make_request([*range(100, 113), 7, 8, 9, 10]))[1] == 0


def test_sessions_yield_their_blocks_before_a_request_would_wait():
    """Kept conversations never cost a live request its room: the least recently used goes first."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, session_cache_fraction=1.0)
    for session_id, start in (("old", 0), ("new", 50)):
        turn = make_request(range(start, start + 12))  # 3 full blocks each
        compute_and_publish(kv, turn)
        finish_turn(kv, turn, session_id)
    assert kv.num_session_blocks == 6 and kv.pool.num_free_blocks == 2
    big = make_request(range(500, 516))  # 4 blocks: only room once "old" is given up
    assert kv.allocate_slots(big, 16)
    assert list(kv.sessions) == ["new"] and kv.num_session_blocks == 3
    assert_pool_consistent(kv, [big])
    huge = make_request(range(600, 632))  # 8 blocks: more than there is, even with every session given up
    assert not kv.allocate_slots(huge, 32)
    assert not kv.sessions and huge.block_ids == []
    assert_pool_consistent(kv, [big])


def test_session_cap_ttl_replacement_and_end():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, session_ttl=60.0, session_cache_fraction=0.25)  # 4
    first = make_request(range(12))  # 3 blocks
    compute_and_publish(kv, first)
    finish_turn(kv, first, "a")
    second = make_request(range(12, 20))  # 2 blocks: "a" and "b" together exceed the cap, "a" goes
    compute_and_publish(kv, second)
    finish_turn(kv, second, "b")
    assert list(kv.sessions) == ["b"] and kv.num_session_blocks == 2
    too_big = make_request(range(100, 120))  # 5 blocks alone exceed the cap: never kept
    compute_and_publish(kv, too_big)
    finish_turn(kv, too_big, "c")
    assert "c" not in kv.sessions
    # A newer turn of "b" replaces its blocks (its first block is shared: held once by the session, not twice).
    again = make_request([*range(12, 20), 1, 2, 3, 4])
    compute_and_publish(kv, again)
    kept = again.block_ids[:3]
    finish_turn(kv, again, "b")
    assert kv.sessions["b"].block_ids == kept
    assert kv.num_session_blocks == 3
    assert_pool_consistent(kv, [])
    kv.expire_sessions(now=kv.sessions["b"].expires_at - 1)
    assert "b" in kv.sessions
    kv.expire_sessions(now=kv.sessions["b"].expires_at)
    assert not kv.sessions and kv.num_session_blocks == 0
    assert kv.pool.num_free_blocks == 16 and kv.get_computed_blocks(make_request([*range(12, 20), 1, 2, 3, 4, 5]))[1]
    assert not kv.end_session("b")
    turn = make_request(range(40, 48))
    compute_and_publish(kv, turn)
    finish_turn(kv, turn, "d")
    assert kv.end_session("d") and not kv.sessions
    assert_pool_consistent(kv, [])


def test_sessions_need_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    turn = make_request(range(12))
    compute_and_publish(kv, turn)
    finish_turn(kv, turn, "conv")
    assert not kv.sessions and kv.pool.num_free_blocks == 8
