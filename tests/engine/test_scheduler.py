"""Scheduler: token budget, chunked prefill, preemption, priority, stops and aborts, with synthetic tokens.

The runner is mimicked: a request gets a sampled token only in the step that computes its last token."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable

import pytest

from serval.config import SchedulerConfig
from serval.engine.kv_cache import KVCacheManager
from serval.engine.request import Request, RequestStatus
from serval.engine.scheduler import Scheduler, SchedulerOutput
from serval.sampling_params import SamplingParams

BLOCK = 4
EOS = 2
_arrival = itertools.count()


def make_scheduler(*, num_blocks: int = 64, max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
                   enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             enable_chunked_prefill=enable_chunked_prefill)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_prefix_caching))


def make_request(request_id: str, prompt: int | list[int], max_tokens: int = 8, *, priority: int = 0,
                 group_id: str | None = None, **params) -> Request:
    prompt_ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt  # no EOS in the prompt
    return Request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}), max_tokens=max_tokens, priority=priority, group_id=group_id,
                   arrival_time=float(next(_arrival)))


def counting_token(request: Request) -> int:
    return 1000 + len(request.output_token_ids)  # never EOS


def assert_consistent(sched: Scheduler) -> None:
    """Block pool invariant, and every live request is in exactly one queue with blocks only if running."""
    pool = sched.kv_cache.pool
    holders = Counter(b for r in sched.running for b in r.block_ids)
    holders.update(b for s in sched.kv_cache.sessions.values() for b in s.block_ids)  # conversation sessions' pins
    for block in pool.blocks:
        assert (block.block_id in pool.free_queue) == (block.ref_count == 0)
        assert block.ref_count == holders[block.block_id], f"block {block.block_id}"
    for r in sched.waiting:
        assert r.block_ids == [] and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
    live = sched.waiting + sched.running
    assert len({id(r) for r in live}) == len(live)
    assert {r.request_id for r in live} == set(sched.requests)
    assert len(sched.running) <= sched.config.max_num_seqs


def step(sched: Scheduler, token_for: Callable[[Request], int] = counting_token) -> tuple[SchedulerOutput, list]:
    """One engine step: schedule, 'run' (sample for requests whose last token is computed), update."""
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert set(out.num_scheduled_tokens) == {r.request_id for r in out.scheduled}
    for r in out.scheduled:  # what the runner relies on: a live request with blocks for every token it computes
        assert r.status == RequestStatus.RUNNING and r not in out.preempted
        assert len(r.block_ids) * BLOCK >= r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
    sampled = {r.request_id: [token_for(r)] for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    updated = sched.update_from_output(out, sampled)
    assert_consistent(sched)
    return out, updated


def step_until(sched: Scheduler, done: Callable[[SchedulerOutput], bool], max_steps: int = 100) -> SchedulerOutput:
    """Steps until ``done(out)`` holds for a step's output; returns that output."""
    for _ in range(max_steps):
        out, _ = step(sched)
        if done(out):
            return out
    raise AssertionError(f"not done after {max_steps} steps")


def run_to_completion(sched: Scheduler, max_steps: int = 500, token_for=counting_token) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "requests never finished"
        outs.append(step(sched, token_for)[0])
    assert sched.kv_cache.pool.num_owned_blocks() == 0
    return outs


# -- token budget and chunked prefill -----------------------------------------------------------------------------


def test_a_long_prompt_is_chunked_to_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", 20, max_tokens=5)
    sched.add_request(request)
    chunks = []
    for _ in range(3):
        out, updated = step(sched)
        chunks.append(out.num_scheduled_tokens["a"])
        if len(chunks) < 3:
            assert updated == [] and request.output_token_ids == []
    assert chunks == [8, 8, 4]
    assert request.num_computed_tokens == 20 and request.output_token_ids == [1000]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}  # now decoding
    run_to_completion(sched)
    assert request.status == RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 5


def test_running_decodes_get_their_token_every_step_while_a_long_prompt_is_chunked():
    sched = make_scheduler(max_num_batched_tokens=8)
    d1, d2 = make_request("d1", 3, max_tokens=50), make_request("d2", 3, max_tokens=50)
    sched.add_request(d1)
    sched.add_request(d2)
    step(sched)  # both prompts fit in one step
    assert len(d1.output_token_ids) == len(d2.output_token_ids) == 1
    long = make_request("long", 30, max_tokens=3)
    sched.add_request(long)
    num_steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens and num_steps < 10:
        before = (len(d1.output_token_ids), len(d2.output_token_ids))
        out, _ = step(sched)
        num_steps += 1
        assert out.scheduled[:2] == [d1, d2]  # decodes go first
        assert out.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 6}
        assert (len(d1.output_token_ids), len(d2.output_token_ids)) == (before[0] + 1, before[1] + 1)
    assert num_steps == 5
    assert len(long.output_token_ids) == 1


def test_running_decodes_are_scheduled_before_a_new_prompt_when_the_budget_is_short():
    sched = make_scheduler(max_num_batched_tokens=4)
    decoders = [make_request(f"d{i}", 1, max_tokens=3) for i in range(4)]
    for r in decoders:
        sched.add_request(r)
    step(sched)
    prompt = make_request("p", 4, max_tokens=2)
    sched.add_request(prompt)
    for _ in range(2):  # 2 more decode steps fill the budget: the prompt waits
        out, _ = step(sched)
        assert out.num_scheduled_tokens == {f"d{i}": 1 for i in range(4)}
        assert prompt.status == RequestStatus.WAITING
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in decoders)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"p": 4}


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 3, max_tokens=4) for i in range(5)]
    for r in requests:
        sched.add_request(r)
    out, _ = step(sched)
    assert [r.request_id for r in out.scheduled] == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    outs = run_to_completion(sched)  # assert_consistent checks the cap every step
    assert max(len(o.scheduled) for o in outs) == 2
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 4 for r in requests)


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    d1, d2 = make_request("d1", 2, max_tokens=4), make_request("d2", 2, max_tokens=4)
    sched.add_request(d1)
    sched.add_request(d2)
    step(sched)
    prompt = make_request("p", 7, max_tokens=2)  # 7 > 8 - 2 decodes
    sched.add_request(prompt)
    scheduled_prompt = []
    while sched.has_unfinished_requests():
        prefilling = prompt.output_token_ids == []
        out, _ = step(sched)
        if prefilling and "p" in out.num_scheduled_tokens:
            scheduled_prompt.append(out.num_scheduled_tokens["p"])
        if d1.status == RequestStatus.RUNNING:
            assert prompt.status == RequestStatus.WAITING and prompt.num_computed_tokens == 0
    assert scheduled_prompt == [7]  # the whole prompt in one step, never a part of it
    assert prompt.status == RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_that_fits_beside_the_decodes_runs_at_once():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    d1, d2 = make_request("d1", 2, max_tokens=4), make_request("d2", 2, max_tokens=4)
    sched.add_request(d1)
    sched.add_request(d2)
    step(sched)
    sched.add_request(make_request("p", 6, max_tokens=2))  # 2 decodes + 6 == 8
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"d1": 1, "d2": 1, "p": 6}


def test_without_chunked_prefill_a_preempted_request_that_outgrew_the_budget_still_finishes():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8, enable_chunked_prefill=False,
                           enable_prefix_caching=False)
    a, c = make_request("a", 2, max_tokens=10), make_request("c", 6, max_tokens=10)
    sched.add_request(a)
    sched.add_request(c)
    # c (6 prompt tokens) is preempted after 3 outputs: 9 tokens to recompute, more than the budget of 8.
    run_to_completion(sched, max_steps=200)
    assert c.status == RequestStatus.FINISHED_LENGTH and len(c.output_token_ids) == 10


# -- preemption ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_takes_the_newest_request_and_it_comes_back_to_finish(enable_prefix_caching):
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=enable_prefix_caching)
    a, b, c = (make_request(rid, [ord(rid)] * 4, max_tokens=10) for rid in "abc")  # 4 prompt tokens each
    for r in (a, b, c):
        sched.add_request(r)
    first_preemption = None
    while sched.has_unfinished_requests():
        running_before = list(sched.running)
        out, _ = step(sched)
        for victim in out.preempted:
            # The newest of the requests that were running goes first (equal priorities).
            still_in = [r for r in running_before if r not in out.preempted or r is victim]
            assert victim is max(still_in, key=lambda r: r.arrival_time)
            assert victim not in out.scheduled
        if out.preempted:  # no admissions in a step that had to preempt
            assert set(out.scheduled) <= set(running_before)
        if out.preempted and first_preemption is None:
            first_preemption = list(out.preempted)
            assert first_preemption == [c]
            assert c.status == RequestStatus.PREEMPTED and c in sched.waiting
            assert c.block_ids == [] and c.num_computed_tokens == 0
            kept = list(c.output_token_ids)
            assert len(kept) == 5  # 4 + 5 tokens need a 3rd block each; 6 blocks hold only 2 requests' worth
            assert a.status == b.status == RequestStatus.RUNNING
            assert sched.num_preemptions == 1
    assert first_preemption is not None
    assert sched.num_preemptions == sum(r.num_preemptions for r in (a, b, c)) >= 1
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [1000 + i for i in range(10)]
    assert c.output_token_ids[:5] == kept
    assert sched.kv_cache.pool.num_owned_blocks() == 0 and sched.requests == {}


def test_a_preempted_request_recomputes_prompt_and_outputs_before_sampling_again():
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    a, b, c = (make_request(rid, 4, max_tokens=10) for rid in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    step_until(sched, lambda out: sched.num_preemptions > 0)
    num_tokens = c.num_tokens
    out = step_until(sched, lambda out: c.status == RequestStatus.RUNNING)
    # Readmitted: all of prompt + kept outputs is scheduled for recompute, and only then a new token comes.
    assert out.num_scheduled_tokens["c"] == num_tokens
    assert c.num_tokens == num_tokens + 1


def test_preemption_takes_the_least_important_request_first():
    sched = make_scheduler(num_blocks=6)
    low = make_request("low", [1] * 4, max_tokens=10, priority=5)  # oldest, but least important
    b, c = make_request("b", [3] * 4, max_tokens=10), make_request("c", [4] * 4, max_tokens=10)
    for r in (low, b, c):
        sched.add_request(r)
    out = step_until(sched, lambda out: bool(out.preempted))
    assert out.preempted == [low]
    assert low.status == RequestStatus.PREEMPTED and b.status == c.status == RequestStatus.RUNNING
    run_to_completion(sched)


def test_a_victim_already_scheduled_in_the_step_is_taken_back_out():
    sched = make_scheduler(num_blocks=6)
    # low is admitted first, so it runs first in each step, and needs its 3rd block a step after the others.
    low = make_request("low", [1] * 2, max_tokens=10, priority=5)
    sched.add_request(low)
    step(sched)
    b, c = make_request("b", [3] * 4, max_tokens=10), make_request("c", [4] * 4, max_tokens=10)
    sched.add_request(b)
    sched.add_request(c)
    out = step_until(sched, lambda out: bool(out.preempted))
    assert out.preempted == [low]
    assert low not in out.scheduled and "low" not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {"b": 1, "c": 1}
    run_to_completion(sched)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in (low, b, c))


# -- priority -----------------------------------------------------------------------------------------------------


def test_lower_priority_value_is_admitted_first_then_arrival_order():
    sched = make_scheduler(max_num_seqs=1)
    requests = [make_request("late-low", 3, max_tokens=2, priority=5), make_request("hi", 3, max_tokens=2),
                make_request("hi-later", 3, max_tokens=2), make_request("urgent", 3, max_tokens=2, priority=-1)]
    for r in requests:
        sched.add_request(r)
    order = []
    for out in run_to_completion(sched):
        order += [r.request_id for r in out.scheduled if r.request_id not in order]
    assert order == ["urgent", "hi", "hi-later", "late-low"]


def test_tenants_take_turns_among_waiting_requests_of_equal_priority():
    """One key's backlog does not starve another's: A queued five before B's two arrived, yet B's first runs second
    and its second right after A's next; priority still comes first."""
    sched = make_scheduler(max_num_seqs=1)
    for i in range(5):
        sched.add_request(dataclasses.replace(make_request(f"a{i}", 3, max_tokens=2), tenant="A"))
    for i in range(2):
        sched.add_request(dataclasses.replace(make_request(f"b{i}", 3, max_tokens=2), tenant="B"))
    sched.add_request(dataclasses.replace(make_request("a-urgent", 3, max_tokens=2, priority=-1), tenant="A"))
    order = []
    for out in run_to_completion(sched):
        order += [r.request_id for r in out.scheduled if r.request_id not in order]
    assert order == ["a-urgent", "b0", "a0", "b1", "a1", "a2", "a3", "a4"]


@pytest.mark.parametrize("short_of", ["seats", "blocks"])
def test_a_more_important_arrival_preempts_a_less_important_running_request(short_of):
    """No seat (max_num_seqs) or no blocks left: a waiting request of higher priority takes the place of the least
    important running one, which is recomputed later and still finishes."""
    seats, blocks = (1, 64) if short_of == "seats" else (4, 4)
    sched = make_scheduler(max_num_seqs=seats, num_blocks=blocks)
    low = make_request("low", [1] * 8, max_tokens=8, priority=5)  # 16 tokens: all 4 blocks of the small cache, alone
    sched.add_request(low)
    step(sched)
    step(sched)
    assert low.status == RequestStatus.RUNNING and len(low.output_token_ids) == 2
    urgent = make_request("urgent", [3] * 8, max_tokens=8, priority=-1)  # shares no cached prefix with low
    sched.add_request(urgent)
    out, _ = step(sched)
    assert out.preempted == [low] and [r.request_id for r in out.scheduled] == ["urgent"]
    assert low.status == RequestStatus.PREEMPTED and low.block_ids == []
    while not urgent.status.finished:  # urgent keeps the place until it is done
        out, _ = step(sched)
        assert "low" not in out.num_scheduled_tokens and "urgent" in out.num_scheduled_tokens
    run_to_completion(sched)
    assert low.status == urgent.status == RequestStatus.FINISHED_LENGTH
    assert low.output_token_ids == [1000 + i for i in range(8)]  # recomputed, then carried on where it was


def test_an_arrival_of_equal_priority_waits_rather_than_preempting():
    sched = make_scheduler(max_num_seqs=1)
    first = make_request("first", 6, max_tokens=8)
    sched.add_request(first)
    step(sched)
    sched.add_request(make_request("second", 6, max_tokens=8))
    outs = run_to_completion(sched)
    assert not any(o.preempted for o in outs) and first.num_preemptions == 0
    # second ran only once first had finished
    assert [sorted(o.num_scheduled_tokens) for o in outs][:7] == [["first"]] * 7


# -- stop conditions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, script, status, num_outputs, stop_reason", [
    pytest.param({}, [5, 6, EOS, 7, 8], RequestStatus.FINISHED_STOPPED, 3, None, id="eos"),
    pytest.param({"ignore_eos": True}, [EOS] * 8, RequestStatus.FINISHED_LENGTH, 6, None, id="ignore_eos"),
    pytest.param({"stop_token_ids": [9]}, [5, 9, 7], RequestStatus.FINISHED_STOPPED, 2, 9, id="stop_token_ids"),
    pytest.param({"min_tokens": 3}, [EOS] * 8, RequestStatus.FINISHED_STOPPED, 3, None, id="min_tokens_eos"),
    pytest.param({"min_tokens": 3}, [EOS, 5, 6, EOS, 7], RequestStatus.FINISHED_STOPPED, 4, None,
                 id="min_tokens_then_eos"),
    pytest.param({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9, 9], RequestStatus.FINISHED_STOPPED, 2, 9,
                 id="min_tokens_stop_token"),
    pytest.param({}, [5] * 8, RequestStatus.FINISHED_LENGTH, 6, None, id="max_tokens"),
])
def test_stop_conditions(params, script, status, num_outputs, stop_reason):
    sched = make_scheduler()
    request = make_request("r", 5, max_tokens=6, **params)
    other = make_request("other", 5, max_tokens=50)
    sched.add_request(request)
    sched.add_request(other)
    finished_step = None
    for i in range(len(script)):
        out, updated = step(sched, lambda r: script[len(r.output_token_ids)] if r is request else 1000)
        if request.status.finished:
            finished_step = i
            assert request in updated  # its last token is reported with the finish
            break
    assert finished_step == num_outputs - 1
    assert request.status == status and request.stop_reason == stop_reason
    assert request.output_token_ids == script[:num_outputs]
    assert request not in sched.running and "r" not in sched.requests and request.block_ids == []
    assert sched.kv_cache.pool.num_owned_blocks() == len(other.block_ids)
    out, _ = step(sched)
    assert out.scheduled == [other]


def test_max_tokens_zero_ends_after_its_last_prompt_chunk_without_a_token():
    sched = make_scheduler(max_num_batched_tokens=4)
    request = make_request("score", 10, max_tokens=0)
    other = make_request("other", 3, max_tokens=20)
    sched.add_request(request)
    sched.add_request(other)
    chunks = []
    while not request.status.finished:
        # The mimicked runner offers a token for every request whose last token it computed: this one takes none.
        out, updated = step(sched)
        chunks.append(out.num_scheduled_tokens.get("score"))
        assert (request in updated) == request.status.finished  # reported once, with its finish
        assert len(chunks) < 10
    assert chunks == [4, 4, 2]
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == []
    assert request.block_ids == [] and "score" not in sched.requests and request not in sched.running
    # Its full prompt blocks were published before they were freed: the same prompt hits them.
    _, num_hit = sched.kv_cache.get_computed_blocks(make_request("again", 10))
    assert num_hit == 8
    run_to_completion(sched)


def test_a_request_that_asks_for_prompt_logprobs_takes_no_prefix_hit():
    sched = make_scheduler()
    sched.add_request(make_request("first", 10, max_tokens=1))
    run_to_completion(sched)
    scored = make_request("scored", 10, max_tokens=1, prompt_logprobs=2)
    plain = make_request("plain", 10, max_tokens=1)
    sched.add_request(scored)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"scored": 10} and scored.num_cached_tokens == 0
    sched.add_request(plain)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"plain": 2} and plain.num_cached_tokens == 8
    run_to_completion(sched)


# -- abort ----------------------------------------------------------------------------------------------------------


def test_abort_a_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 5), make_request("wait", 5)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    sched.finish_request(waiting, RequestStatus.FINISHED_ABORTED)
    assert waiting.status == RequestStatus.FINISHED_ABORTED and waiting not in sched.waiting
    sched.finish_request(waiting, RequestStatus.FINISHED_ABORTED)  # twice: harmless
    assert_consistent(sched)
    run_to_completion(sched)
    assert waiting.output_token_ids == [] and running.status == RequestStatus.FINISHED_LENGTH


def test_abort_a_running_request_frees_its_blocks():
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 9, max_tokens=50), make_request("wait", 5, max_tokens=2)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    step(sched)
    assert len(running.block_ids) == 3
    sched.finish_request(running, RequestStatus.FINISHED_ABORTED)
    assert running.status == RequestStatus.FINISHED_ABORTED and running.block_ids == []
    assert sched.kv_cache.pool.num_owned_blocks() == 0 and sched.running == []
    sched.finish_request(running, RequestStatus.FINISHED_ABORTED)
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert_consistent(sched)
    out, _ = step(sched)  # its seat goes to the waiting one
    assert out.scheduled == [waiting]
    run_to_completion(sched)


def test_abort_while_a_step_runs_drops_that_steps_token():
    sched = make_scheduler()
    request, other = make_request("r", 5), make_request("other", 5, max_tokens=2)
    sched.add_request(request)
    sched.add_request(other)
    out = sched.schedule()
    sched.finish_request(request, RequestStatus.FINISHED_ABORTED)
    updated = sched.update_from_output(out, {"r": [7], "other": [8]})
    assert updated == [other]
    assert request.output_token_ids == [] and request.status == RequestStatus.FINISHED_ABORTED
    assert_consistent(sched)
    run_to_completion(sched)


def test_abort_a_preempted_request():
    sched = make_scheduler(num_blocks=6)
    a, b, c = (make_request(rid, [ord(rid)] * 4, max_tokens=10) for rid in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    step_until(sched, lambda out: c.status == RequestStatus.PREEMPTED)
    sched.finish_request(c, RequestStatus.FINISHED_ABORTED)
    assert c.status == RequestStatus.FINISHED_ABORTED and c not in sched.waiting
    assert_consistent(sched)
    run_to_completion(sched)
    assert len(c.output_token_ids) < 10


# -- prefix cache stats ------------------------------------------------------------------------------------------


def test_prefix_cache_stats_count_each_admitted_request_once():
    sched = make_scheduler(num_blocks=3)  # a (8 + 4 tokens) takes all 3 blocks: b waits for a to finish
    a, b = make_request("a", 8, max_tokens=4), make_request("b", 8, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched)
    assert sched.num_preemptions == 0 and b.num_cached_tokens == 4
    assert sched.kv_cache.stats.queried_tokens == 16
    assert sched.kv_cache.stats.hit_tokens == 4


# -- n > 1 groups ---------------------------------------------------------------------------------------------------


def test_siblings_wait_for_the_first_prompt_then_share_its_cached_blocks():
    sched = make_scheduler(max_num_batched_tokens=16)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks and a partial one
    siblings = [make_request(f"g#{i}", prompt, max_tokens=8, group_id="g") for i in range(3)]
    loner = make_request("loner", 3, max_tokens=4)
    for r in [*siblings, loner]:
        sched.add_request(r)
    out, _ = step(sched)
    # Budget was left (16 - 10 - 3), but the siblings wait while the first one prefills; others do not.
    assert out.num_scheduled_tokens == {"g#0": 10, "loner": 3}
    leader = siblings[0]
    for _ in range(10):
        waiting = [r for r in siblings if r.status == RequestStatus.WAITING]
        if not waiting:
            break
        out, _ = step(sched)
        for sibling in waiting:
            if sibling in out.scheduled:
                assert out.num_scheduled_tokens[sibling.request_id] == 2  # 8 of its 10 prompt tokens were cached
    for sibling in siblings[1:]:
        assert sibling.num_cached_tokens == 8
        assert sibling.block_ids[:2] == leader.block_ids[:2]
        assert sibling.block_ids[2] != leader.block_ids[2]  # the partial block is never shared
    assert [sched.kv_cache.pool.blocks[b].ref_count for b in leader.block_ids[:2]] == [3, 3]
    assert sched.kv_cache.stats.hit_tokens == 16
    run_to_completion(sched)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in siblings)


def test_siblings_are_admitted_together_once_the_first_prompt_is_cached():
    sched = make_scheduler(max_num_batched_tokens=16)
    siblings = [make_request(f"g#{i}", 10, max_tokens=4, group_id="g") for i in range(4)]
    for r in siblings:
        sched.add_request(r)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"g#0": 10}
    out, _ = step(sched)
    # The 2 full blocks are cached; every sibling only needs its 2-token tail, and 1 + 3 * 2 fits the budget.
    assert out.num_scheduled_tokens == {"g#0": 1, "g#1": 2, "g#2": 2, "g#3": 2}


def test_without_prefix_caching_siblings_are_not_held_back():
    sched = make_scheduler(max_num_batched_tokens=32, enable_prefix_caching=False)
    siblings = [make_request(f"g#{i}", 10, max_tokens=4, group_id="g") for i in range(3)]
    for r in siblings:
        sched.add_request(r)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"g#0": 10, "g#1": 10, "g#2": 10}
    assert all(r.num_cached_tokens == 0 for r in siblings)
    run_to_completion(sched)
