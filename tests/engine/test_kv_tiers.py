"""The KV cache's second tier on the real model, in the default dtype: a prefix evicted from the KV cache comes back
from host RAM or disk (also after a restart), and a request swapped out on preemption resumes where it was; the
greedy answers are the same as with a cache that never evicted or preempted anything."""

from __future__ import annotations

import pytest

from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16)
PROMPT = "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France " \
    "built machines that riders pushed along with their feet."
# Other prompts, each about 60 tokens: together several times the free blocks of a 16-block cache.
TRAFFIC = [f"Request {i}: " + "Describe the weather, the sea, the harbour and the boats of a small town. " * 4
           for i in range(6)]
SMALL = dict(dtype="bfloat16", num_blocks=16, speculative_model=None, max_num_batched_tokens=128)


def _ask(llm, prompt: str, params: SamplingParams = GREEDY):
    engine = llm.engine
    before = engine.stats.num_scheduled_tokens
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    return output, engine.stats.num_scheduled_tokens - before


def _cycle_the_cache(llm) -> None:
    for text in TRAFFIC:
        llm.generate([text], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def test_an_evicted_prefix_comes_back_from_host_ram(make_llm):
    reference = make_llm(dtype="bfloat16", speculative_model=None).generate([PROMPT], GREEDY, use_tqdm=False)[0]
    llm = make_llm(**SMALL, kv_offload_size=0.02)
    first, _ = _ask(llm, PROMPT)
    _cycle_the_cache(llm)
    kv = llm.engine.kv_cache
    assert not kv.get_computed_blocks(_request_like(llm, PROMPT))[0].device  # evicted from the KV cache
    second, computed = _ask(llm, PROMPT)
    num_prompt = len(second.prompt_token_ids)
    assert second.num_cached_tokens == (num_prompt - 1) // 16 * 16 > 0  # every full block, from the second tier
    assert computed == num_prompt - second.num_cached_tokens + len(second.outputs[0].token_ids) - 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == reference.outputs[0].token_ids
    stats = llm.engine.stats
    assert stats.offload_hit_tokens == second.num_cached_tokens and stats.offload_loaded_blocks >= num_prompt // 16
    tiers = llm.engine.kv_state()["tiers"]
    assert [t["tier"] for t in tiers] == ["cpu", "host"] and tiers[1]["cached"] == stats.offload_cached_blocks > 0


def _request_like(llm, prompt: str):
    from serval.engine.request import Request
    return Request("probe", llm.engine.tokenizer.encode(prompt), GREEDY)


def test_a_disk_tier_serves_the_prefix_cache_of_the_last_run_after_a_restart(make_llm, tmp_path):
    first_run = make_llm(**SMALL, kv_offload_size=0.02, kv_offload_path=str(tmp_path))
    first, _ = _ask(first_run, PROMPT)  # still in the KV cache at shutdown: the shutdown saves it
    first_run.engine.shutdown()

    restarted = make_llm(**SMALL, kv_offload_size=0.02, kv_offload_path=str(tmp_path))
    again, computed = _ask(restarted, PROMPT)
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    assert computed == len(again.prompt_token_ids) - again.num_cached_tokens + len(again.outputs[0].token_ids) - 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    restarted.engine.shutdown()

    # Another dtype computes other keys and values: the files are started over, nothing is hit.
    other = make_llm(**{**SMALL, "dtype": "float32"}, kv_offload_size=0.02, kv_offload_path=str(tmp_path))
    fresh, _ = _ask(other, PROMPT)
    assert fresh.num_cached_tokens == 0
    other.engine.shutdown()


PROMPTS = [f"Story {i}: once upon a time in a land far away, there lived a" for i in range(8)]
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _batch(llm) -> tuple[list[list[int]], int]:
    before = llm.engine.stats.num_scheduled_tokens
    outputs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.stats.num_scheduled_tokens - before


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_a_swapped_out_request_resumes_where_it_was_with_the_same_answer(make_llm, mode):
    unpreempted, computed_once = _batch(make_llm(dtype="bfloat16", speculative_model=None))
    llm = make_llm(**SMALL, kv_offload_size=0.02, preemption_mode=mode)
    answers, computed = _batch(llm)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_swaps == scheduler.num_preemptions
    assert computed == computed_once  # nothing was computed twice
    assert answers == unpreempted
    tier = llm.engine.kv_cache.offload
    assert tier.num_swapped == 0 and tier.stats.loaded_blocks > 0  # every swapped block came back


def test_recompute_mode_computes_again_and_gives_the_same_answer(make_llm):
    unpreempted, computed_once = _batch(make_llm(dtype="bfloat16", speculative_model=None))
    llm = make_llm(**SMALL, kv_offload_size=0.02, preemption_mode="recompute")
    answers, computed = _batch(llm)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_swaps == 0
    assert computed > computed_once
    assert answers == unpreempted
