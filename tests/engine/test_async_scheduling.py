"""Async scheduling (SchedulerConfig.async_scheduling): with multi-step decoding, the next run of the same decodes
is queued on the device before the host reads the last run's tokens. On the CPU the padded decode buckets
(EngineConfig.pad_decode_on_cpu) run the same code uncaptured, so these tests check what it must keep: every
request's tokens and finish are the one-step engine's (seeded draws included), beside late arrivals, stops inside a
run, aborts while a run is queued, preemption and prefix hits, and every KV block comes back. The GPU tests
(test_cuda_graphs.py, test_cuda_server.py) check it on CUDA."""

from __future__ import annotations

import pytest
import torch
from core_runs import EOS, mixed_finals, mixed_params, run_requests
from tiny_models import tiny_llama

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.engine.request import RequestStatus
from serval.model.loader import load_model

PROMPTS = [list(range(10, 10 + n)) for n in (5, 17, 30, 9, 12, 3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=5).save_pretrained(path, safe_serialization=True)
    return path, load_model(path, torch.float32)


def _core(tiny, steps: int = 4, async_scheduling: bool = True, num_blocks: int = 64, budget: int = 512,
          max_num_seqs: int = 64) -> tuple[EngineCore, list[tuple[int, int]]]:
    """An engine core on the tiny model with the padded decode buckets, and a list that gets (forwards, rows) of each
    run queued before the last one's tokens were read."""
    path, model = tiny
    core = EngineCore(EngineConfig(dtype="float32", max_model_len=128, speculative=SpeculativeConfig(method=None),
                                   cache=CacheConfig(block_size=16, num_blocks=num_blocks), pad_decode_on_cpu=True,
                                   scheduler=SchedulerConfig(num_scheduler_steps=steps, max_num_batched_tokens=budget,
                                                             async_scheduling=async_scheduling,
                                                             max_num_seqs=max_num_seqs)), path, model)
    queued, launch_next_run = [], core.runner.launch_next_run

    def recording(previous, out):
        # A queued run computes no token its requests may not take, whatever the run before it gives them.
        assert all(len(r.output_token_ids) + previous.out.num_decode_steps + out.num_decode_steps <= r.max_tokens
                   for r in out.scheduled)
        run = launch_next_run(previous, out)
        if run is not None:
            queued.append((out.num_decode_steps, len(out.scheduled)))
        return run

    core.runner.launch_next_run = recording
    return core, queued


def _greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **params)


def _stop_inside_a_run(tiny, prompt: list[int], index: int) -> int:
    """A token the free-running greedy output of ``prompt`` first meets at ``index`` (a stop there)."""
    free = run_requests(_core(tiny, 1, async_scheduling=False)[0], [(prompt, _greedy(40, ignore_eos=True))])["r0"][0]
    token = free[index]
    assert free.index(token) == index, "the probe token occurs earlier: pick another index"
    return token


def test_queued_runs_give_the_one_step_engines_tokens_beside_late_requests_and_stops(tiny):
    """Six greedy requests of several lengths, one stopping on a token met inside its third run, two of them added
    after the third step: the same tokens and finishes as one forward a step and as multi-step runs read one at a
    time, and runs were queued (the steady state between the arrivals)."""
    stop = _stop_inside_a_run(tiny, PROMPTS[2], 9)
    requests = [(PROMPTS[0], _greedy(30, ignore_eos=True)), (PROMPTS[1], _greedy(23, ignore_eos=True)),
                (PROMPTS[2], _greedy(35, stop_token_ids=[stop], ignore_eos=True)),
                (PROMPTS[3], _greedy(13)), (PROMPTS[4], _greedy(27, ignore_eos=True)),
                (PROMPTS[5], _greedy(19, ignore_eos=True))]
    expected = run_requests(_core(tiny, 1, async_scheduling=False)[0], requests, late=2)
    assert expected["r2"][1] == ["stop"] and expected["r2"][0][-1] == stop and len(expected["r2"][0]) == 10
    assert run_requests(_core(tiny, 4, async_scheduling=False)[0], requests, late=2) == expected
    core, queued = _core(tiny, 4)
    assert run_requests(core, requests, late=2) == expected
    # Runs of 4, and the last ones cut to what their requests may take.
    assert any(steps == 4 for steps, _ in queued) and any(steps < 4 for steps, _ in queued)


def test_queued_runs_of_sampled_rows_draw_the_one_step_engines_tokens_and_logprobs(tiny):
    """Seeded sampled rows (temperature, top-k, top-p; one asking for 3 top logprobs) beside a greedy one asking for
    logprobs, one of them ending on eos: runs of them are queued, each drawing with its generators at the output
    positions after the run before it, so every token and logprob is the one forward a step gives."""
    requests = [(PROMPTS[0], SamplingParams(temperature=0.8, seed=21, max_tokens=26, ignore_eos=True)),
                (PROMPTS[1], SamplingParams(temperature=1.0, top_k=4, seed=22, max_tokens=30, logprobs=3)),
                (PROMPTS[2], SamplingParams(temperature=0.6, top_p=0.85, seed=23, max_tokens=19, ignore_eos=True)),
                (PROMPTS[3], _greedy(23, ignore_eos=True, logprobs=1))]
    one_logprobs, queued_logprobs = {}, {}
    expected = run_requests(_core(tiny, 1, async_scheduling=False)[0], requests, logprobs=one_logprobs)
    core, queued = _core(tiny, 4)
    assert run_requests(core, requests, logprobs=queued_logprobs) == expected
    assert queued_logprobs == one_logprobs and set(one_logprobs) == {"r1", "r3"}
    assert any(steps == 4 and rows == len(requests) for steps, rows in queued)


def test_a_stop_inside_a_run_drops_the_queued_run_of_that_request(tiny):
    """A request alone that stops on the 7th token (inside its second run of 4, while its third run is queued):
    its output ends with that token, its blocks all come back, and the engine is left with nothing queued."""
    stop = _stop_inside_a_run(tiny, PROMPTS[1], 6)
    requests = [(PROMPTS[1], _greedy(30, stop_token_ids=[stop], ignore_eos=True))]
    expected = run_requests(_core(tiny, 1, async_scheduling=False)[0], requests)
    core, queued = _core(tiny, 4)
    got = run_requests(core, requests)
    assert got == expected and got["r0"][1] == ["stop"] and len(got["r0"][0]) == 7
    assert queued  # the run after the stop was queued, then dropped


def test_an_abort_while_a_run_is_queued_leaves_the_others_unchanged(tiny):
    """Aborting one request after the fourth step, while a run of it is queued: the others get their tokens as
    without the abort, the aborted one's output stops there, and its blocks come back."""
    requests = [(prompt, _greedy(30, ignore_eos=True)) for prompt in PROMPTS[:4]]
    expected = run_requests(_core(tiny, 1, async_scheduling=False)[0], requests)
    core, queued = _core(tiny, 4)
    got = run_requests(core, requests, abort_at={4: "r1"})
    assert queued
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == expected[rid]
    tokens, finish = got["r1"]
    assert finish == [] and 0 < len(tokens) < 30 and tokens == expected["r1"][0][:len(tokens)]


def test_a_waiting_request_is_scheduled_before_another_run_is_queued(tiny):
    """A request that arrives while runs are queued waits for the queued run only: the step after it reads that
    run schedules it (no run is queued while a request waits)."""
    core, queued = _core(tiny, 4)
    params = _greedy(40, ignore_eos=True)
    core.add_request(EngineCoreRequest("first", PROMPTS[0], params, [EOS], 40))
    for _ in range(4):
        core.step()
    assert core._launched is not None  # the steady state: a run queued behind the one read
    core.add_request(EngineCoreRequest("late", PROMPTS[1], params, [EOS], 40))
    core.step()  # reads the queued run; queues none, since "late" waits
    assert core._launched is None
    core.step()
    assert "late" in {r.request_id for r in core.scheduler.running}
    core.finish_requests(["first", "late"], RequestStatus.FINISHED_ABORTED)
    while core.has_unfinished_requests():
        core.step()
    assert core.kv_cache.pool.num_owned_blocks() == 0


def test_runs_are_queued_while_requests_wait_for_a_seat(tiny):
    """With every seat taken (max_num_seqs 2, six requests) the waiting requests could not get in anyway: runs are
    queued while they wait, each gets in once a seat frees (a run later at most), and every request's tokens and
    finish are the one-step engine's."""
    stop = _stop_inside_a_run(tiny, PROMPTS[2], 9)
    requests = [(PROMPTS[2], _greedy(20, stop_token_ids=[stop], ignore_eos=True))]
    requests += [(prompt, _greedy(9 + 4 * i, ignore_eos=True)) for i, prompt in enumerate(PROMPTS[:2] + PROMPTS[3:])]
    expected = run_requests(_core(tiny, 1, async_scheduling=False, max_num_seqs=2)[0], requests)
    core, queued = _core(tiny, 4, max_num_seqs=2)
    waiting_when_queued, schedule_next_run = [], core.scheduler.schedule_next_run

    def recording(out):
        following = schedule_next_run(out)
        if following is not None:
            waiting_when_queued.append(len(core.scheduler.waiting))
        return following

    core.scheduler.schedule_next_run = recording
    assert run_requests(core, requests) == expected
    assert queued and any(waiting_when_queued)


def test_preemption_prefix_hits_and_the_budget_keep_the_tokens(tiny):
    """Too few blocks for every request (preemption, and runs that cannot queue their slots), then the same prompts
    again (prefix-cache hits), and a token budget that cuts runs short: the one-step engine's tokens every time."""
    requests = [(prompt, _greedy(24, ignore_eos=True)) for prompt in PROMPTS[:5]]
    one = _core(tiny, 1, async_scheduling=False, num_blocks=12)[0]
    expected = run_requests(one, requests)
    assert one.scheduler.num_preemptions > 0
    core, queued = _core(tiny, 4, num_blocks=12)
    assert run_requests(core, requests) == expected
    hits = core.snapshot().prefix_cache_hit_tokens
    assert run_requests(core, requests) == expected
    assert core.snapshot().prefix_cache_hit_tokens > hits
    budgeted, queued_budgeted = _core(tiny, 8, budget=12)
    assert run_requests(budgeted, requests) == run_requests(_core(tiny, 1, async_scheduling=False)[0], requests)
    assert queued_budgeted and all(steps * rows <= 12 for steps, rows in queued_budgeted)


def test_async_scheduling_is_off_by_default_and_a_flag():
    from serval.cli import _engine_config, build_parser

    assert not SchedulerConfig().async_scheduling
    args = build_parser().parse_args(["serve", "--async-scheduling", "--num-scheduler-steps", "4"])
    config = _engine_config(args)
    assert config.scheduler.async_scheduling and config.scheduler.num_scheduler_steps == 4


@pytest.mark.slow
def test_the_embedded_model_with_queued_runs_finishes_every_request_as_one_step_a_token_does(make_llm):
    """The embedded model in bf16 with async output processing (a stop string is then found a step late, while a run
    of its request is queued): greedy requests that end on eos, on a stop string completed inside a run, on
    max_tokens, after min_tokens, beside a seeded sampled one, give the one-step engine's text, tokens and finish."""
    one = make_llm(dtype="bfloat16", num_scheduler_steps=1, speculative_model=None)
    params = mixed_params(one)
    stop = params[1].stop[0]

    def finals(llm):
        return mixed_finals(llm, params)

    expected = finals(one)
    assert expected[1][2:] == ("stop", stop)
    queued = make_llm(dtype="bfloat16", num_scheduler_steps=4, speculative_model=None, async_output_processing=True,
                      async_scheduling=True, pad_decode_on_cpu=True)
    core = queued.engine.core
    launches, launch_next_run = [], core.runner.launch_next_run
    core.runner.launch_next_run = lambda *args: launches.append(launch_next_run(*args)) or launches[-1]
    assert finals(queued) == expected
    assert any(run is not None for run in launches)
    assert queued.engine.kv_cache.pool.num_owned_blocks() == 0 and core._launched is None
