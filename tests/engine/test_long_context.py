"""A long prompt in the default dtype: chunked prefill at the default token budget (16 chunks of 128 tokens, each
attending to everything before it in the paged cache) gives the same greedy answer as the whole prompt in one
step, and the engine's step memory stays bounded (benchmarks/bench_long_context.py measures 1k-8k)."""

from __future__ import annotations

import pytest

from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PARAGRAPH = ("Section {i}. The harbour town woke slowly: fishing boats came back with the tide, the market opened "
             "its stalls of bread, cheese and fruit, and children ran along the sea wall on their way to school. ")


def _answer(llm, prompt: list[int]) -> tuple[list[int], int]:
    engine = llm.engine
    steps = engine.stats.num_steps
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=12))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    return tokens, engine.stats.num_steps - steps


def test_a_2k_prompt_chunked_equals_one_step(make_llm):
    chunked = make_llm(dtype="bfloat16", max_num_batched_tokens=128, max_model_len=4096, num_blocks=260,
                       speculative_model=None)
    ids: list[int] = []
    i = 0
    while len(ids) < 2048:
        ids += chunked.engine.tokenizer.encode(PARAGRAPH.format(i=i), add_special_tokens=False)
        i += 1
    prompt = ids[:2048] + chunked.engine.tokenizer.encode(" Question: what opened its stalls?",
                                                          add_special_tokens=False)
    answer, steps = _answer(chunked, prompt)
    assert len(prompt) > 2048 and answer
    assert steps == -(-len(prompt) // 128) + len(answer) - 1  # 17 chunks (the last samples), then a step a token
    whole = make_llm(dtype="bfloat16", max_num_batched_tokens=4096, max_model_len=4096, num_blocks=260,
                     speculative_model=None)
    answer_whole, steps_whole = _answer(whole, prompt)
    assert steps_whole == len(answer_whole)
    assert answer == answer_whole
