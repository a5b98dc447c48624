"""Prompt logprobs (SamplingParams.prompt_logprobs) on the real embedded model (float32): they equal transformers'
log-softmax on the same token ids however the prompt is chunked, cached or preempted, and max_tokens=0 scores a
prompt without generating."""

from __future__ import annotations

import math

import pytest
import torch
from real_model import MODEL_PATH

from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = ("The serval is a wild cat native to Africa. It is rarely found in rainforest and desert areas. "
          "It has the longest legs of any cat relative to its body size, and large ears that help it hear")
# Measured: max |ours - transformers| = 1.5e-5 over this prompt's 41 scored tokens and their top 5 (chunked or
# not), with logprobs down to -16.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def prompt_ids(smollm_fp32) -> list[int]:
    ids = smollm_fp32[1].encode(PROMPT)
    assert 30 <= len(ids) <= 60
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids) -> torch.Tensor:
    """transformers' [T, vocab] float32 log-softmax of the prompt, from the same GGUF file."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL_PATH.parent, gguf_file=MODEL_PATH.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)


def _values(prompt_logprobs) -> list[float]:
    return [lp.logprob for lp in prompt_logprobs[1:]]


def _assert_match(prompt_logprobs, prompt_ids: list[int], reference: torch.Tensor, num_top: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for i, lp in enumerate(prompt_logprobs[1:], start=1):
        row = reference[i - 1]  # position i - 1 predicts token i
        assert lp.token_id == prompt_ids[i]
        assert lp.logprob == pytest.approx(row[prompt_ids[i]].item(), abs=TOLERANCE)
        assert (lp.rank == 1) == (next(iter(lp.top)) == lp.token_id)
        assert len(lp.top) == num_top
        top = list(lp.top.values())
        assert top == sorted(top, reverse=True)
        assert top[0] == pytest.approx(row.max().item(), abs=TOLERANCE)  # the argmax comes first
        assert int(row.argmax()) in lp.top or top[0] - top[1] < TOLERANCE  # (a near-tie may swap the two)
        for token, value in lp.top.items():
            assert value == pytest.approx(row[token].item(), abs=TOLERANCE)


@pytest.mark.parametrize("budget", [512, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_match_transformers(make_llm, prompt_ids, reference, budget):
    llm = make_llm(quantization="none", max_num_batched_tokens=budget, enable_prefix_caching=False)
    scored = llm.generate([prompt_ids], SamplingParams(max_tokens=0, prompt_logprobs=5), use_tqdm=False)[0]
    _assert_match(scored.prompt_logprobs, prompt_ids, reference, 5)
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].text == ""
    assert scored.outputs[0].finish_reason == "length" and scored.finished
    if budget == 7:
        assert llm.engine.stats.num_steps == math.ceil(len(prompt_ids) / 7)  # really chunked; no extra step
    # Generating after the prompt changes nothing in its logprobs, and adds the usual per-token ones.
    generated = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5,
                                                          logprobs=1), use_tqdm=False)[0]
    assert _values(generated.prompt_logprobs) == pytest.approx(_values(scored.prompt_logprobs), abs=1e-6)
    assert len(generated.outputs[0].token_ids) == 3 and len(generated.outputs[0].logprobs) == 3
    assert llm.engine.kv_cache.pool.num_owned_blocks() == 0


def test_prompt_logprobs_ignore_the_prefix_cache(make_llm, prompt_ids, reference):
    llm = make_llm(quantization="none", enable_prefix_caching=True)
    plain = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0
    scored = llm.generate([prompt_ids], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # the cache held most of the prompt, but keeps no logits
    _assert_match(scored.prompt_logprobs, prompt_ids, reference, 2)
    again = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(make_llm, monkeypatch):
    prompts = [f"Fact {i}: {PROMPT}" for i in range(3)]
    unpressed = make_llm().generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    # 8 blocks of 16 tokens for 3 requests of 46 + 20 tokens: measured, one request is preempted in the middle of
    # its prompt (its scored chunks are scored again) and one while it decodes (its prompt is not scored again).
    llm = make_llm(num_blocks=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    scheduler = llm.engine.scheduler
    preempted = []
    preempt = scheduler._preempt
    monkeypatch.setattr(scheduler, "_preempt", lambda r: (preempted.append(bool(r.output_token_ids)), preempt(r)))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    pressed = llm.generate(prompts, params, use_tqdm=False)
    assert sorted(set(preempted)) == [False, True]
    for alone, batched in zip(unpressed, pressed):
        assert len(batched.prompt_logprobs) == len(batched.prompt_token_ids)
        assert _values(batched.prompt_logprobs) == pytest.approx(_values(alone.prompt_logprobs), abs=1e-4)
    assert llm.engine.kv_cache.pool.num_owned_blocks() == 0


def test_max_tokens_zero_runs_the_prompt_only(make_llm):
    llm = make_llm(max_model_len=64)
    engine = llm.engine
    prompt = list(range(100, 164))  # fills the whole context: allowed only when nothing is generated after it
    with pytest.raises(ValueError, match="context"):
        engine.add_request("too-long", prompt, SamplingParams(max_tokens=1))
    out = llm.generate([prompt], SamplingParams(max_tokens=0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs is None  # not asked for
    assert engine.stats.num_scheduled_tokens == 64 and engine.stats.num_generated_tokens == 0
    assert engine.kv_cache.pool.num_owned_blocks() == 0


def test_n_samples_share_one_scoring_of_the_prompt(make_llm, prompt_ids, reference):
    llm = make_llm(quantization="none")
    out = llm.generate([prompt_ids], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=1),
                       use_tqdm=False)[0]
    _assert_match(out.prompt_logprobs, prompt_ids, reference, 1)
    assert [len(c.token_ids) for c in out.outputs] == [4, 4, 4]
    # Only the first sample computed the whole prompt; the others took its cached full blocks.
    full_blocks = (len(prompt_ids) - 1) // 16 * 16
    assert llm.engine.stats.num_scheduled_tokens == len(prompt_ids) + 2 * (len(prompt_ids) - full_blocks) + 3 * 3
