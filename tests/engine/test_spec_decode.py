"""Speculative decoding (n-gram prompt lookup): the proposer and the acceptance rule; the scheduler's accounting of
guessed tokens; greedy and seeded output identical with and without speculation in the default configuration, alone
and batched; and, on a tiny model with a small support, the sampled output distribution is the target's
(chi-square against the exact probabilities)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from real_model import requires_model
from tiny_models import full_logits, tiny_llama

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.engine.kv_cache import KVCacheManager
from serval.engine.messages import EngineCoreRequest
from serval.engine.request import Request, RequestStatus
from serval.engine.scheduler import Scheduler
from serval.engine.spec_decode import NgramProposer, accept
from serval.layers.attention.torch_reference import TorchReferenceBackend
from serval.model.loader import load_model

# -- the proposer and the rule ------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert proposer.propose(tokens, 3) == [7, 8, 5]  # "2 3" last seen at 5-6 (not 1-2), then 7 8 5
    assert proposer.propose(tokens + [7], 2) == [8, 5]  # "2 3 7" (n = 3) wins over shorter ones
    assert proposer.propose([1, 2, 3, 4], 3) == []  # no earlier "3 4"
    assert proposer.propose([5, 5, 5], 4) == [5]  # the suffix itself is never its own match
    assert proposer.propose([1, 2, 3, 1, 2], 0) == []
    assert proposer.propose([1, 2, 3, 1, 2], 9) == [3, 1, 2]  # what there is, up to k


def test_accept_keeps_matching_guesses_then_the_targets_own_token():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus the token after the last guess
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first miss ends it, with the target's token
    assert accept([4, 5], [8, 5, 6]) == [8]
    assert accept([], [3]) == [3]


# -- scheduler accounting -----------------------------------------------------------------------------------------


def _decoding_request(sched: Scheduler) -> Request:
    request = Request("r", list(range(10, 18)), SamplingParams(max_tokens=20), max_tokens=20)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {"r": [100]})  # prompt computed, first token sampled
    return request


def test_guesses_are_scheduled_with_the_decode_and_only_accepted_ones_count_as_computed():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(16, 4, True))
    request = _decoding_request(sched)
    request.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 4} and out.spec_token_ids == {"r": [101, 102, 103]}
    assert len(request.block_ids) * 4 >= 9 + 3  # slots for every guess
    sched.update_from_output(out, {"r": [101, 102, 555]})  # two accepted, then the target's own token
    assert request.output_token_ids == [100, 101, 102, 555]
    assert request.num_computed_tokens == 8 + 3 == request.num_tokens - 1  # the last token is the next input
    assert request.spec_token_ids == []
    out = sched.schedule()  # no guesses now: a plain decode
    assert out.num_scheduled_tokens == {"r": 1} and out.spec_token_ids == {}
    sched.update_from_output(out, {"r": [556]})  # 13 tokens
    request.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert len(request.block_ids) == 5  # slots up to position 12 + 4
    sched.update_from_output(out, {"r": [9]})  # every guess rejected: 14 tokens need 4 blocks
    assert len(request.block_ids) == 4 and request.num_computed_tokens == 13
    assert sched.kv_cache.pool.num_free_blocks == 16 - 4  # the slack block went back to the pool


def test_guesses_are_cut_to_the_budget_and_dropped_without_room():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(16, 4, True))
    request = _decoding_request(sched)
    sched.config.max_num_batched_tokens = 3  # the decode and two guesses fit
    request.spec_token_ids = [101, 102, 103, 104]
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [101, 102]} and out.num_scheduled_tokens == {"r": 3}
    sched.update_from_output(out, {"r": [7]})  # the first guess missed
    assert request.num_computed_tokens == request.num_tokens - 1

    tight = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(3, 4, True))  # 12 slots
    request = _decoding_request(tight)
    request.spec_token_ids = [1] * 8  # 9 + 8 slots: more than the cache has
    out = tight.schedule()
    assert out.num_scheduled_tokens == {"r": 1} and out.spec_token_ids == {} and not out.preempted


def test_a_stop_among_accepted_guesses_ends_the_request_there():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(16, 4, True))
    request = _decoding_request(sched)
    request.eos_token_ids = frozenset({2})
    request.spec_token_ids = [101, 2, 103]
    out = sched.schedule()
    sched.update_from_output(out, {"r": [101, 2, 103, 104]})
    assert request.output_token_ids == [100, 101, 2] and request.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache.pool.num_owned_blocks() == 0


# -- the real model, default configuration --------------------------------------------------------------------------

# Input-grounded prompts: the answer repeats what the prompt says, so prompt lookup finds guesses.
GROUNDED = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "Alice said hello to Bob. Bob said hello to Carol. Carol said hello to Dave. Dave said hello to",
    "The list: apples, pears, plums, apples, pears, plums, apples, pears,",
]
FREE = ["Once upon a time, in a small village by the sea,", "The three primary colors are"]


def _engines(make_llm):
    dtype = str(EngineConfig().torch_dtype).removeprefix("torch.")  # what users get on this machine
    plain = make_llm(dtype=dtype, speculative_model=None)
    spec = make_llm(dtype=dtype, speculative_model="ngram", num_speculative_tokens=4, speculative_max_batch_size=64)
    return plain, spec


@pytest.mark.slow
@requires_model
def test_greedy_and_seeded_outputs_are_identical_with_speculation_alone_and_batched(make_llm):
    plain, spec = _engines(make_llm)
    prompts = GROUNDED + FREE
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    for params in (greedy, seeded):
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        batched = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert batched == expected
        alone = [spec.generate(p, q, use_tqdm=False)[0].outputs[0].token_ids
                 for p, q in zip(prompts, params if isinstance(params, list) else [params] * len(prompts))]
        assert alone == expected
    stats = spec.engine.stats
    # The equality above was reached through guesses: many were checked, and many accepted.
    assert stats.spec_num_drafts > 50 and stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens * 0.3
    assert stats.spec_accepted_per_position[0] >= stats.spec_accepted_per_position[-1] > 0
    assert spec.engine.kv_cache.pool.num_owned_blocks() == 0


@pytest.mark.slow
@requires_model
def test_speculation_keeps_logprobs_stop_strings_and_max_tokens(make_llm):
    plain, spec = _engines(make_llm)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=2, stop=["lazy dog"])
    want, got = plain.generate(GROUNDED[0], params, use_tqdm=False)[0], spec.generate(GROUNDED[0], params,
                                                                                       use_tqdm=False)[0]
    assert got.outputs[0].text == want.outputs[0].text and got.outputs[0].finish_reason == "stop"
    assert got.outputs[0].logprobs == want.outputs[0].logprobs
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    got = spec.generate(GROUNDED[2], params, use_tqdm=False)[0].outputs[0]
    assert len(got.token_ids) == 7 and got.finish_reason == "length"


@pytest.mark.slow
@requires_model
@pytest.mark.parametrize("method", ["ngram", "smollm2-135m-instruct", "self-layers:20", "self-int4"])
def test_speculation_is_unchanged_by_preemption_prefix_hits_and_n(make_llm, method):
    """Guesses scheduled in a cache too small for the batch (requests preempted and recomputed, guesses dropped for
    lack of room), then the same prompts again (prefix-cache hits), with n = 2 seeded samples: the outputs of the
    plain engine with room to spare. For every proposer: prompt lookup, a separate draft model (the embedded model
    itself), an early exit, the model's own 4-bit blocks."""
    dtype = str(EngineConfig().torch_dtype).removeprefix("torch.")
    plain = make_llm(dtype=dtype, speculative_model=None)
    tight = make_llm(dtype=dtype, num_blocks=14, max_model_len=224, speculative_model=method,
                     speculative_max_batch_size=64)
    prompts = GROUNDED + FREE
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    pairs = SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=20, ignore_eos=True)
    for params in (greedy, pairs):
        expected = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
        for _ in range(2):  # the second time, prompts hit the prefix cache
            got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
            assert got == expected
    engine = tight.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.stats.hit_tokens > 0
    assert engine.stats.spec_num_accepted_tokens > 0  # (an early exit too: 3-5% of its guesses)
    assert engine.kv_cache.pool.num_owned_blocks() == 0


@pytest.mark.slow
@requires_model
def test_speculation_on_the_pytorch_attention_path(make_llm):
    """The path CUDA takes (decode tables, chunk masks) checks guesses as a chunk with earlier context: the same
    greedy tokens as its own plain decode."""
    plain, spec = _engines(make_llm)
    for llm in (plain, spec):
        runner = llm.engine.runner
        runner.attention_backend = TorchReferenceBackend(runner.device, runner.kv_cache.dtype, runner.block_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(GROUNDED[:3], params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(GROUNDED[:3], params, use_tqdm=False)] == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0


# -- draft models: early exit and a separate draft ----------------------------------------------------------------


@pytest.mark.slow
@requires_model
def test_a_draft_that_is_the_target_has_every_greedy_guess_accepted(make_llm):
    """The draft's own cache keeps up with the target's (mirrored steps, prefix-cache hits, preemption): a draft
    with the target's weights, in float32, guesses exactly the target's greedy tokens, so every guess is accepted.
    A stale or misplaced draft cache would guess wrong."""
    spec = make_llm(dtype="float32", num_blocks=16, max_model_len=224, speculative_model="smollm2-135m-instruct",
                    speculative_max_batch_size=64, num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for _ in range(2):
        spec.generate(GROUNDED + FREE, params, use_tqdm=False)
    stats = spec.engine.stats
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.kv_cache.stats.hit_tokens > 0
    assert stats.spec_num_draft_tokens > 100
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_speculative_model_names_are_checked():
    assert SpeculativeConfig(method="self-layers:6").early_exit_layers == 6
    assert SpeculativeConfig(method="some/draft").draft_model == "some/draft"
    assert SpeculativeConfig(method="ngram").draft_model is None
    assert SpeculativeConfig(method="self-int4").draft_model is None
    for bad in ("self-layers:0", "self-layers:x", "", "none"):
        with pytest.raises(ValueError):
            SpeculativeConfig(method=bad)


# -- the sampled distribution is the target's ----------------------------------------------------------------------

TOP_K = 3
TEMPERATURE = 1.5
NUM_SAMPLES = 3000
CHI2_CRITICAL_26_DOF_P001 = 54.05  # chi-square quantile 0.999 at 26 degrees of freedom (27 cells)


class FixedGuess:
    """A deterministic proposer that always guesses the same token: accepted as often as the target samples it."""

    needs_slots = False

    def __init__(self, token: int) -> None:
        self.token = token

    def propose_requests(self, requests, num_tokens: list[int]) -> list[list[int]]:
        return [[self.token] * k for k in num_tokens]


def _target_probabilities(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The exact probability of each 3-token continuation under top-k and temperature, from full forwards."""
    def next_probs(ids):
        logits = full_logits(model, ids)[-1].double() / TEMPERATURE
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    table = {}
    for a, pa in next_probs(prompt).items():
        for b, pb in next_probs(prompt + [a]).items():
            for c, pc in next_probs(prompt + [a, b]).items():
                table[(a, b, c)] = pa * pb * pc
    return table


def test_sampled_output_distribution_with_speculation_is_the_targets(tmp_path):
    hf = tiny_llama(seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32)
    prompt = [11, 12, 13, 14]
    config = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512),
                          scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=1024),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2, max_batch_size=256))
    target = _target_probabilities(model, prompt)
    second = Counter()
    for (_, b, _), p in target.items():
        second[b] += p
    guess = second.most_common(1)[0][0]  # the likeliest second token: guesses get accepted and rejected
    core = EngineCore(config, tmp_path, model)
    core.speculator.proposer = FixedGuess(guess)
    torch.manual_seed(0)  # unseeded requests draw from the global generator: a fixed run, not a flaky one
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, ignore_eos=True)
    samples: dict[str, list[int]] = {}
    for i in range(NUM_SAMPLES):
        core.add_request(EngineCoreRequest(f"s{i}", prompt, params, [], 3))
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            samples.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = core.stats
    assert 0.1 * stats.spec_num_draft_tokens < stats.spec_num_accepted_tokens < 0.9 * stats.spec_num_draft_tokens

    counts = Counter(tuple(s) for s in samples.values())
    assert sum(counts.values()) == NUM_SAMPLES and set(counts) <= set(target)
    chi2 = sum((counts[cell] - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for cell, p in target.items())
    assert chi2 < CHI2_CRITICAL_26_DOF_P001, chi2

    # The statistic has the power to reject a wrong rule: keeping every guess (b == guess always) fails it by far.
    kept_all = Counter()
    for (a, _, c), n in counts.items():
        kept_all[(a, guess, c)] += n
    chi2_wrong = sum((kept_all[cell] - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for cell, p in target.items())
    assert chi2_wrong > 10 * CHI2_CRITICAL_26_DOF_P001


def test_seeded_sampling_is_reproducible_and_fixed_by_seed_and_position(tmp_path):
    hf = tiny_llama(seed=4)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32)

    def run(speculative: bool, batch: list[int]) -> dict[int, list[int]]:
        config = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=128), speculative=SpeculativeConfig(
            method="ngram" if speculative else None, num_speculative_tokens=3, max_batch_size=64))
        core = EngineCore(config, tmp_path, model)
        if speculative:
            core.speculator.proposer = FixedGuess(7)
        for seed in batch:
            core.add_request(EngineCoreRequest(f"{seed}", [5, 6, 7], SamplingParams(
                temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True), [], 12))
        tokens: dict[int, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens.setdefault(int(out.request_id), []).extend(out.new_token_ids)
        return tokens

    reference = run(False, [1])
    assert run(False, [1]) == reference  # reproducible
    mixed = run(True, [1, 2, 3, 4])
    assert mixed[1] == reference[1]  # with guesses and other requests beside it: the same tokens
    assert mixed[2] != mixed[3]  # different seeds, different samples
    assert len(set(itertools.chain.from_iterable(mixed.values()))) > 3


@requires_model
def test_a_batch_limit_of_zero_never_speculates(make_llm):
    """--speculative-max-batch-size 0 (CUDA's default: a guess-checking step runs eagerly there, the decode step
    as a CUDA graph) keeps the proposer but never proposes, even for one request on quoting text."""
    never = make_llm(speculative_model="ngram", speculative_max_batch_size=0)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    never.generate(GROUNDED[:1], greedy, use_tqdm=False)
    assert never.engine.core.stats.spec_num_drafts == 0
    once = make_llm(speculative_model="ngram", speculative_max_batch_size=1)
    once.generate(GROUNDED[:1], greedy, use_tqdm=False)
    assert once.engine.core.stats.spec_num_drafts > 0
