"""Disaggregated prefill/decode in one process: a prefill EngineCore holds a prompt's KV, a decode EngineCore fetches
it over ZeroMQ/TCP (engine/kv_transfer.py) and continues. In the default dtype, greedy output equals one worker's,
batched or not; blocks the decode side's prefix cache has are not sent; a transfer a router names before either
worker has the request sends blocks while the prefill still computes; holds nobody fetches expire and give their
blocks back; a failed, aborted or mismatched transfer is computed locally or refused with a clear error."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from serval.config import EngineConfig, KVTransferConfig
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.model.registry import resolve_model_path
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from serverproc import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TOKENS = 24
STORY = ("The lighthouse keeper climbed the stairs every evening, counting the steps, lighting the lamp and "
         "watching the ships pass the rocks below. ")


@pytest.fixture(scope="module")
def cores():
    path = resolve_model_path(None)
    single = EngineCore(EngineConfig(), path)  # the default dtype and flags: what users get
    prefill = EngineCore(EngineConfig(kv_transfer=KVTransferConfig(role="prefill", timeout=60)), path,
                         model=single.model)
    decode = EngineCore(EngineConfig(kv_transfer=KVTransferConfig(role="decode")), path, model=single.model)
    yield single, prefill, decode, Tokenizer.load(path)
    for core in (single, prefill, decode):
        core.shutdown()


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> tuple[dict[str, list[int]], dict[str, dict]]:
    """Steps the core until the requests end: (tokens, kv_transfer_params) by request id."""
    for request in requests:
        core.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    held = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.kv_transfer_params is not None:
                held[out.request_id] = out.kv_transfer_params
    return tokens, held


def _request(request_id: str, ids: list[int], tok: Tokenizer, max_tokens: int = TOKENS, kv: dict | None = None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, kv_transfer_params=kv)
    return EngineCoreRequest(request_id, ids, params, sorted(tok.eos_token_ids), max_tokens)


def _chunk_blocks(core: EngineCore) -> int:
    """Full blocks of one prefill chunk: the core's token budget (the CPU's default: 128 with AVX-512, 96 with AVX2)
    over the block size."""
    budget, block_size = core.config.scheduler.max_num_batched_tokens, core.config.cache.block_size
    assert budget % block_size == 0, (budget, block_size)
    return budget // block_size


def _prefill(prefill: EngineCore, tok: Tokenizer, prompts: dict[str, list[int]]) -> dict[str, dict]:
    _, held = _run(prefill, [_request(f"p-{k}", ids, tok, 1, {"do_remote_decode": True}) for k, ids in prompts.items()])
    return {k: {**held[f"p-{k}"], "do_remote_prefill": True} for k in prompts}


def test_greedy_output_equals_one_worker_and_held_blocks_come_back(cores):
    single, prefill, decode, tok = cores
    story = tok.encode(STORY * 6)
    prompts = {  # one token (nothing to fetch), one block exactly plus the last token, chunked (> 128), plain
        "one": story[:1], "block": story[:17], "long": story[:170], "mid": tok.encode("Name three rivers in Europe.")}
    expected, _ = _run(single, [_request(k, ids, tok) for k, ids in prompts.items()])
    params = _prefill(prefill, tok, prompts)
    assert all(params[k]["num_tokens"] == len(ids) for k, ids in prompts.items())
    assert prefill.snapshot().kv_held_blocks == sum(-(-len(ids) // 16) for ids in prompts.values())
    got, _ = _run(decode, [_request(k, ids, tok, kv=params[k]) for k, ids in prompts.items()])  # one batch
    assert got == expected
    stats = decode.snapshot()
    assert stats.kv_failed_fetches == 0
    # What was sent: the blocks of all but the last prompt token, none of them in the decode side's cache yet.
    assert stats.kv_received_blocks == sum(-(-(len(ids) - 1) // 16) for ids in prompts.values())
    assert prefill.snapshot().kv_sent_blocks == stats.kv_received_blocks
    prefill.poll_kv_transfers()
    assert prefill.snapshot().kv_held_blocks == 0
    assert prefill.snapshot().num_free_blocks == prefill.snapshot().num_blocks  # nothing owned: all came back
    assert decode.snapshot().num_free_blocks == decode.snapshot().num_blocks


def test_blocks_the_decode_side_has_cached_are_not_sent(cores):
    single, prefill, decode, tok = cores
    orchard = "In the old orchard the apples ripened late, and the children gathered them in baskets each autumn. "
    shared = tok.encode(orchard * 4)[:64]  # four full blocks no earlier test cached
    first, second = shared + tok.encode(" Who lit the lamp?"), shared + tok.encode(" What did he count?")
    expected, _ = _run(single, [_request("a", first, tok), _request("b", second, tok)])
    params = _prefill(prefill, tok, {"a": first})
    before = decode.snapshot().kv_received_blocks
    got_a, _ = _run(decode, [_request("a", first, tok, kv=params["a"])])
    after_first = decode.snapshot().kv_received_blocks
    assert after_first - before == -(-(len(first) - 1) // 16)
    params = _prefill(prefill, tok, {"b": second})
    got_b, _ = _run(decode, [_request("b", second, tok, kv=params["b"])])
    # The shared 64 tokens were in the decode side's prefix cache: only the blocks after them came.
    assert decode.snapshot().kv_received_blocks - after_first == -(-(len(second) - 1) // 16) - 4
    assert {**got_a, **got_b} == expected
    prefill.poll_kv_transfers()
    assert prefill.snapshot().kv_held_blocks == 0


def test_an_unfetched_hold_expires_and_a_decode_worker_then_computes_the_prompt(cores):
    single, _, decode, tok = cores
    path = resolve_model_path(None)
    short = EngineCore(EngineConfig(kv_transfer=KVTransferConfig(role="prefill", timeout=0.5)), path,
                       model=single.model)
    try:
        ids = tok.encode("Write a haiku about the sea.")
        params = _prefill(short, tok, {"x": ids})["x"]
        assert short.snapshot().kv_held_blocks > 0
        time.sleep(0.8)
        assert short.poll_kv_transfers()  # the hold expired: its blocks are free again
        stats = short.snapshot()
        assert stats.kv_held_blocks == 0 and stats.kv_expired_holds == 1
        assert stats.num_free_blocks == stats.num_blocks
        failed = decode.snapshot().kv_failed_fetches
        got, _ = _run(decode, [_request("x", ids, tok, kv=params)])
        assert decode.snapshot().kv_failed_fetches == failed + 1  # fell back: computed here, the same tokens
        assert got == _run(single, [_request("x", ids, tok)])[0]
    finally:
        short.shutdown()


def test_transfers_this_worker_cannot_use_fail_clearly_or_fall_back(cores):
    single, prefill, decode, tok = cores
    ids = tok.encode("List the planets of the solar system.")
    params = _prefill(prefill, tok, {"x": ids})["x"]
    # Another prompt under these params: the blocks are not used (the hold ends), the answer is the right one.
    other = tok.encode("List the moons of Jupiter.")
    got, _ = _run(decode, [_request("other", other, tok, kv=params)])
    assert got == _run(single, [_request("other", other, tok)])[0]
    prefill.poll_kv_transfers()
    assert prefill.snapshot().kv_held_blocks == 0

    def error_of(core, request):
        core.add_request(request)
        outs = [o for o in core.step().outputs if o.request_id == request.request_id]
        assert outs and outs[0].finish_reason == "error"
        return outs[0].error

    bad_layout = {**params, "layout": {**params["layout"], "block_size": 32}}
    assert "layout" in error_of(decode, _request("layout", ids, tok, kv=bad_layout))
    assert "decode worker" in error_of(prefill, _request("wrong-side", ids, tok, kv=params))
    assert "prefill worker" in error_of(decode, _request("wrong-ask", ids, tok, kv={"do_remote_decode": True}))
    assert decode.snapshot().num_free_blocks == decode.snapshot().num_blocks


def _router_named(prefill: EngineCore, transfer_id: str) -> tuple[dict, dict]:
    """The two workers' params for a transfer a router names before either worker has the request."""
    return ({"do_remote_decode": True, "transfer_id": transfer_id},
            {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_address": prefill.kv_transfer.address})


def _finish(core: EngineCore, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_a_router_named_transfer_sends_blocks_while_the_prefill_still_computes(cores):
    single, prefill, decode, tok = cores
    ids = tok.encode("A river runs through the valley, past mills and bridges and fields of barley. " * 40)[:500]
    expected, _ = _run(single, [_request("r", ids, tok)])
    to_prefill, to_decode = _router_named(prefill, "route-r-1")
    sent_before, early_before = prefill.snapshot().kv_sent_blocks, prefill.snapshot().kv_sent_early_blocks
    decode.add_request(_request("r", ids, tok, kv=to_decode))  # asks before the prefill worker has the request
    decode.step()
    prefill.add_request(_request("p-r", ids, tok, 1, to_prefill))
    chunk_blocks = _chunk_blocks(prefill)
    held, chunks = {}, 0
    while prefill.has_unfinished_requests():
        for out in prefill.step().outputs:
            held[out.request_id] = out.kv_transfer_params
        chunks += 1
        if prefill.has_unfinished_requests():
            # This chunk's full blocks go to the decode worker while the prefill has more chunks to compute.
            n = chunk_blocks * chunks
            assert wait_for(lambda n=n: prefill.snapshot().kv_sent_blocks - sent_before >= n, 10, 0.01)
            assert prefill.snapshot().kv_sent_blocks - sent_before == n
    assert chunks == -(-len(ids) // (16 * chunk_blocks))  # 128 + 128 + 128 + 116 tokens with AVX-512's budget
    assert prefill.snapshot().kv_sent_early_blocks - early_before == chunk_blocks * (chunks - 1)
    assert held["p-r"]["transfer_id"] == "route-r-1" and held["p-r"]["num_tokens"] == len(ids)
    got = _finish(decode, {})
    assert got == expected
    assert prefill.snapshot().kv_sent_blocks - sent_before == -(-(len(ids) - 1) // 16)
    prefill.poll_kv_transfers()
    assert prefill.snapshot().num_free_blocks == prefill.snapshot().num_blocks
    assert decode.snapshot().num_free_blocks == decode.snapshot().num_blocks


def test_a_prefill_aborted_mid_transfer_leaves_the_decode_worker_computing_the_prompt(cores):
    single, prefill, decode, tok = cores
    ids = tok.encode("The baker rose before dawn to knead the dough and light the ovens of the village. " * 20)[:300]
    expected, _ = _run(single, [_request("a", ids, tok)])
    to_prefill, to_decode = _router_named(prefill, "route-a-1")
    failed = decode.snapshot().kv_failed_fetches
    sent_before = prefill.snapshot().kv_sent_blocks
    prefill.add_request(_request("p-a", ids, tok, 1, to_prefill))
    prefill.step()
    decode.add_request(_request("a", ids, tok, kv=to_decode))
    decode.step()
    assert wait_for(lambda: prefill.snapshot().kv_sent_blocks - sent_before >= _chunk_blocks(prefill), 10, 0.01)
    prefill.finish_requests(["p-a"])  # the client went away: its blocks are freed, the transfer fails
    assert _finish(decode, {}) == expected
    assert decode.snapshot().kv_failed_fetches == failed + 1
    assert prefill.snapshot().num_free_blocks == prefill.snapshot().num_blocks
    assert decode.snapshot().num_free_blocks == decode.snapshot().num_blocks


def test_a_transfer_that_never_reaches_the_prefill_worker_is_computed_on_the_decode_worker(cores, monkeypatch):
    from serval.engine import kv_transfer

    single, prefill, decode, tok = cores
    monkeypatch.setattr(kv_transfer, "OPEN_GRACE_S", 0.5)
    ids = tok.encode("Describe a quiet harbour at night.")
    _, to_decode = _router_named(prefill, "route-lost-1")  # the router's prefill request failed on the way
    failed = decode.snapshot().kv_failed_fetches
    decode.add_request(_request("x", ids, tok, kv=to_decode))
    got = _finish(decode, {})
    assert got == _run(single, [_request("x", ids, tok)])[0]
    assert decode.snapshot().kv_failed_fetches == failed + 1


def test_roles_are_refused_where_they_cannot_work():
    with pytest.raises(ValueError, match="role"):
        KVTransferConfig(role="decoder")
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(tensor_parallel_size=2, kv_transfer=KVTransferConfig(role="prefill"))


def test_a_transfer_that_ended_while_its_prefill_ran_gives_the_blocks_back_when_it_completes():
    """A send that failed mid-fetch ends the transfer while the request still runs; when the request then ends, its
    blocks are released (nobody will fetch them) instead of held, and the step loop gets no params."""
    import torch

    from serval.engine.kv_transfer import ZmqKVConnector

    cache = torch.zeros(2, 2, 8, 16, 1, 4)  # [layer, k/v, block, slot, kv head, row]
    connector = ZmqKVConnector(KVTransferConfig(role="prefill"), cache, {"model": "tiny"})
    try:
        assert connector.open("t-1", list(range(40)), 16) is None
        assert "already in use" in connector.open("t-1", list(range(40)), 16)
        connector.progress("t-1", [3, 5])
        with connector._lock:
            connector._end_hold("t-1", "the send failed")  # what the KV server does when a send raises
        assert connector.take_released() == []  # an open hold's blocks are its request's
        assert connector.complete("t-1", [3, 5, 6], 40) is None
        assert connector.take_released() == [3, 5, 6]
        assert connector.stats.held_blocks == 0
        connector.open("t-2", list(range(20)), 16)
        params = connector.complete("t-2", [1, 2], 20)
        assert params["transfer_id"] == "t-2" and connector.stats.held_blocks == 2
    finally:
        connector.close()
