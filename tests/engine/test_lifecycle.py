"""A request's life in the engine, on the real model: whatever ends it (length, stop, abort, error), its outputs
end exactly once with a finish reason; and the KV cache is one tensor, allocated at start-up, that steps write into
and never replace, even under preemption."""

from __future__ import annotations

from collections import defaultdict

import pytest

from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital city of Korea is", "Once upon a time, there lived", "def fibonacci(n):",
           "The three primary colors are", "A list of fruits: apple, banana,", "The quick brown fox"]
# 8 blocks of 16 tokens hold 128 tokens: six requests of about 35 tokens each must take turns (preemption).
NUM_BLOCKS = 8
FINISH_REASONS = {"stop", "length", "abort", "error"}


def test_every_request_ends_exactly_once_with_a_finish_reason(make_llm):
    engine = make_llm(num_blocks=NUM_BLOCKS).engine
    greedy = SamplingParams(temperature=0, max_tokens=24)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy)
    engine.add_request("stop", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[" "]))
    engine.add_request("n3", PROMPTS[1], SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=12))
    engine.add_request("waiting", PROMPTS[2], greedy)
    engine.abort_request("waiting")  # aborted before it ever ran
    _, broken = engine.outputs.samples["r5"]

    def fail(token_id):
        raise RuntimeError("detokenizer exploded")

    broken.detokenizer.add = fail  # r5 fails on its first token
    outputs = defaultdict(list)
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        if num_steps == 3:
            engine.abort_request("r1")  # aborted while running...
            engine.abort_request("r1")  # ...twice: the second is ignored
        for output in engine.step():
            outputs[output.request_id].append(output)
    assert engine.scheduler.num_preemptions > 0

    for request_id, stream in outputs.items():
        assert [o.finished for o in stream].count(True) == 1 and stream[-1].finished, request_id
        for index in range(len(stream[-1].outputs)):
            reasons = [o.outputs[index].finish_reason for o in stream]
            # None until the one moment it ends, then that reason and no other.
            first = next(i for i, r in enumerate(reasons) if r is not None)
            assert set(reasons[:first]) <= {None} and reasons[first] in FINISH_REASONS, request_id
            assert set(reasons[first:]) == {reasons[first]}, request_id
    reasons = {rid: stream[-1].outputs[0].finish_reason for rid, stream in outputs.items()}
    assert reasons["r1"] == reasons["waiting"] == "abort"
    assert reasons["r5"] == "error" and reasons["stop"] == "stop"
    assert {reasons[f"r{i}"] for i in (0, 2, 3, 4)} <= {"stop", "length"}
    assert len(outputs["n3"][-1].outputs) == 3

    engine.abort_request("r0")  # already finished: nothing more comes
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_owned_blocks() == 0


def test_the_kv_cache_is_allocated_once_and_steps_write_into_it(make_llm):
    llm = make_llm(num_blocks=NUM_BLOCKS)
    engine = llm.engine
    cache = engine.runner.kv_cache
    address = cache.data_ptr()
    config = engine.model.config
    assert tuple(cache.shape) == (config.num_layers, 2, NUM_BLOCKS, 16, config.num_kv_heads, config.head_dim)
    assert not cache.any()  # zeros at start-up
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0  # blocks were freed and reused along the way
    assert engine.runner.kv_cache is cache and cache.data_ptr() == address
    assert tuple(cache.shape)[2] == NUM_BLOCKS
    assert cache.any()  # the steps wrote their keys and values into this very tensor
