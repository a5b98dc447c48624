"""Async output processing (SchedulerConfig.async_output_processing, on by default on CUDA): the front end works on
step N's core outputs while the device computes step N+1. Outputs come one step later and are otherwise exactly the
synchronous engine's: the same stream of outputs per request, stops, and every KV block given back (aborts and a
failing detokenizer: test_engine.py::test_no_block_owned_after_finished_aborted_and_failed[True]). On the CPU the
forward holds the host, so the overlap gains nothing here; what is tested is that nothing else changes."""

from __future__ import annotations

import pytest

from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital city of Korea is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "A list of fruits: apple, banana,", "The three primary colors are"]
# Greedy rows, a stop string (test_each_...: three characters from the middle of the greedy text, so it ends the
# request in the front end), a seeded sampled row, two samples of one prompt, logprobs, a one-token request and
# min_tokens with stop ids: the front end's and the core's ways to end a request.
PARAMS = [SamplingParams(temperature=0, max_tokens=24),
          SamplingParams(temperature=0, max_tokens=30),
          SamplingParams(temperature=0.8, seed=7, max_tokens=20),
          SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12),
          SamplingParams(temperature=0, max_tokens=16, logprobs=2),
          SamplingParams(temperature=0, max_tokens=1),
          SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[13])]


def _run(engine, requests) -> tuple[dict[str, list[tuple]], int]:
    """Every output each request got, in order, as (text, token ids, finish and stop reasons, logprobs) per sample;
    and the number of steps."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    seen: dict[str, list[tuple]] = {request_id: [] for request_id, _, _ in requests}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            seen[out.request_id].append(tuple((c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason,
                                               repr(c.logprobs)) for c in out.outputs))
    return seen, steps


def _requests(params=PARAMS):
    return [(f"r{i}", PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]


def test_each_request_gets_the_synchronous_engines_outputs_one_step_later(make_llm):
    sync = make_llm(dtype="bfloat16", async_output_processing=False).engine
    overlapped = make_llm(dtype="bfloat16", async_output_processing=True).engine
    full = _run(sync, [("probe", PROMPTS[1], PARAMS[1])])[0]["probe"][-1][0][0]  # r1's greedy text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    params = [PARAMS[0], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), *PARAMS[2:]]
    expected, sync_steps = _run(sync, _requests(params))
    got, steps = _run(overlapped, _requests(params))
    assert got == expected
    assert expected["r1"][-1][0][2:4] == ("stop", stop)  # the stop string did end one request in the front end
    assert steps == sync_steps + 1  # the last step only hands out the outputs of the one before
    for engine in (sync, overlapped):
        pool = engine.kv_cache.pool
        assert pool.num_owned_blocks() == 0 and pool.num_free_blocks == engine.kv_cache.num_blocks


def test_a_first_step_hands_out_nothing_and_the_next_one_the_first_tokens(make_llm):
    engine = make_llm(async_output_processing=True).engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == []  # the prompt's forward ran; its token reaches the front end during the next step
    first = engine.step()
    assert [len(out.outputs[0].token_ids) for out in first] == [1]
    while engine.has_unfinished_requests():
        last = engine.step()
    assert last[0].finished and len(last[0].outputs[0].token_ids) == 3

