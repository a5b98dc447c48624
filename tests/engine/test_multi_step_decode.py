"""Multi-step decoding (SchedulerConfig.num_scheduler_steps, CUDA's default): a step of decodes only, greedy or
sampled, runs several forwards in a row, each one's tokens the next one's inputs on the device. Every request's
tokens and finish are the one-step engine's (seeded draws included), with the padded decode buckets and without,
with the logprobs rows ask for, beside prefills, rows that need the host each token (penalties), preemption and
prefix-cache hits; a stop inside a run drops what follows it and every KV block comes back."""

from __future__ import annotations

import pytest
import torch
from core_runs import mixed_finals, mixed_params, run_requests
from tiny_models import tiny_llama

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.layers import cpu_kernels
from serval.layers.attention import ScheduledSequence
from serval.layers.attention.cpu_kernel import CpuKernelBackend
from serval.model.loader import load_model

PROMPTS = [list(range(10, 10 + n)) for n in (5, 17, 30, 9, 12)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=5).save_pretrained(path, safe_serialization=True)
    return path, load_model(path, torch.float32)


def _core(tiny, steps: int, num_blocks: int = 64, budget: int = 512, **config) -> tuple[EngineCore, list]:
    """An engine core on the tiny model, and a list that gets each step's (forwards in a row, request ids)."""
    path, model = tiny
    core = EngineCore(EngineConfig(dtype="float32", max_model_len=128, speculative=SpeculativeConfig(method=None),
                                   cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(num_scheduler_steps=steps, max_num_batched_tokens=budget),
                                   **config), path, model)
    plans, execute = [], core.runner.execute

    def recording(out, *args, **kwargs):
        plans.append((out.num_decode_steps, sorted(r.request_id for r in out.scheduled)))
        return execute(out, *args, **kwargs)

    core.runner.execute = recording
    return core, plans


def _greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **params)


# Greedy rows of several lengths (none a multiple of the run), one that stops on its first eos-like stop id, one
# that ignores eos: runs end early for some and are cut to what the others may still take.
GREEDY = [(PROMPTS[0], _greedy(13)), (PROMPTS[1], _greedy(7, ignore_eos=True)), (PROMPTS[2], _greedy(21)),
          (PROMPTS[3], _greedy(10, stop_token_ids=[])), (PROMPTS[4], _greedy(17, ignore_eos=True))]


@pytest.mark.parametrize("pad_decode_on_cpu", [False, True])
def test_greedy_requests_get_the_one_step_engines_tokens_in_runs_of_forwards(tiny, pad_decode_on_cpu):
    """Requests added at the start and after the third step (their prefills break the runs): the same tokens and
    finish reasons as one forward a step, in fewer steps, with runs of 4 forwards and shorter ones at the ends."""
    one, one_plans = _core(tiny, 1, pad_decode_on_cpu=pad_decode_on_cpu)
    expected = run_requests(one, GREEDY, late=2)
    multi, plans = _core(tiny, 4, pad_decode_on_cpu=pad_decode_on_cpu)
    graphs, greedy_runs = multi.runner.decode_graphs, []
    if pad_decode_on_cpu:  # the padded buckets move the inputs on themselves (CUDA's way, uncaptured)
        run_decodes = graphs.run_decodes
        graphs.run_decodes = lambda *args: greedy_runs.append(args[3]) or run_decodes(*args)
    assert run_requests(multi, GREEDY, late=2) == expected
    assert (4 in greedy_runs) == pad_decode_on_cpu
    if pad_decode_on_cpu:  # one forward a step prepares no greedy forwards (on CUDA: captures none at start-up)
        assert graphs.runs_in_a_row and not one.runner.decode_graphs.runs_in_a_row
    runs = [steps for steps, _ in plans]
    assert {steps for steps, _ in one_plans} == {1}
    assert 4 in runs and any(1 < steps < 4 for steps in runs)  # a run cut to the tokens its requests may take
    assert len(plans) < len(one_plans)
    assert all(len(tokens) == params.max_tokens for (tokens, _), (_, params) in zip(expected.values(), GREEDY)
               if params.ignore_eos)


def test_a_stop_inside_a_run_drops_the_tokens_after_it(tiny):
    """A stop token met in the middle of a run ends the request there: its output is the one-step engine's, which
    ends with that token, and the run's later tokens are dropped."""
    one, _ = _core(tiny, 1)
    free = run_requests(one, [(PROMPTS[2], _greedy(20, ignore_eos=True))])["r0"][0]
    stop = free[5]  # the sixth token: inside the second run of 4
    requests = [(PROMPTS[2], _greedy(20, stop_token_ids=[stop], ignore_eos=True))]
    expected = run_requests(_core(tiny, 1)[0], requests)
    multi, plans = _core(tiny, 4)
    got = run_requests(multi, requests)
    assert got == expected
    assert got["r0"][0] == free[:free.index(stop) + 1] and got["r0"][1] == ["stop"]
    assert [steps for steps, _ in plans] == [1, 4, 4][:len(plans)]


# Seeded sampled rows, each with other filters (temperature alone, top-k, top-p with min-p, a logit bias), one
# that may end on eos and one past its min_tokens after a few steps.
SAMPLED = [(PROMPTS[1], SamplingParams(temperature=0.8, seed=11, max_tokens=14, ignore_eos=True)),
           (PROMPTS[2], SamplingParams(temperature=1.0, top_k=5, seed=12, max_tokens=11)),
           (PROMPTS[3], SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=13, max_tokens=17,
                                       ignore_eos=True)),
           (PROMPTS[4], SamplingParams(temperature=0.9, logit_bias={7: 5.0}, seed=14, max_tokens=9, min_tokens=3))]


@pytest.mark.parametrize("pad_decode_on_cpu", [False, True])
def test_sampled_rows_run_in_a_row_with_the_one_step_engines_draws(tiny, pad_decode_on_cpu):
    """Seeded sampled rows beside greedy ones run in runs of forwards (on the padded buckets through the sampler's
    draw, each token fed to the next forward on the device), and each draws the tokens it draws one forward a step:
    a seeded draw depends on the seed and the output position alone."""
    requests = GREEDY[:2] + SAMPLED
    expected = run_requests(_core(tiny, 1, pad_decode_on_cpu=pad_decode_on_cpu)[0], requests, late=1)
    multi, plans = _core(tiny, 4, pad_decode_on_cpu=pad_decode_on_cpu)
    draws = []
    if pad_decode_on_cpu:
        run_decodes = multi.runner.decode_graphs.run_decodes
        multi.runner.decode_graphs.run_decodes = lambda *args: draws.append(args[4]) or run_decodes(*args)
    assert run_requests(multi, requests, late=1) == expected
    sampled_ids = {f"r{i}" for i in range(2, len(requests))}
    assert any(steps == 4 and sampled_ids & set(ids) for steps, ids in plans)
    if pad_decode_on_cpu:  # the sampled runs went through the buckets with the sampler's draw
        assert any(draw is not None for draw in draws)


def test_rows_with_logprobs_run_in_a_row_with_the_one_step_engines_logprobs(tiny):
    """Greedy and seeded sampled rows asking for logprobs (0, 2 and 5 top ones) beside rows that do not: they run in
    runs of forwards, and every token, its logprob, rank and top logprobs are the one-step engine's."""
    asking = [(PROMPTS[1], SamplingParams(temperature=0, logprobs=2, max_tokens=10, ignore_eos=True)),
              (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, logprobs=5, seed=3, max_tokens=13)),
              (PROMPTS[3], SamplingParams(temperature=1.0, logprobs=0, seed=4, max_tokens=9, ignore_eos=True))]
    requests = GREEDY[:2] + SAMPLED[:1] + asking
    for pad_decode_on_cpu in (False, True):
        one_logprobs, multi_logprobs = {}, {}
        expected = run_requests(_core(tiny, 1, pad_decode_on_cpu=pad_decode_on_cpu)[0], requests,
                                logprobs=one_logprobs)
        multi, plans = _core(tiny, 4, pad_decode_on_cpu=pad_decode_on_cpu)
        assert run_requests(multi, requests, logprobs=multi_logprobs) == expected
        assert multi_logprobs == one_logprobs and set(one_logprobs) == {"r3", "r4", "r5"}
        assert all(len(one_logprobs[rid]) == len(expected[rid][0]) for rid in one_logprobs)
        assert [len(lp.top) for lp in one_logprobs["r4"]] == [5] * len(expected["r4"][0])
        assert any(steps == 4 and {"r3", "r4", "r5"} <= set(ids) for steps, ids in plans)


def test_a_row_with_a_penalty_runs_its_batch_one_forward_a_step(tiny):
    """A row whose token needs the host (a penalty over its output so far) makes its batch take one forward a step
    while it runs; every row keeps its tokens and the seeded ones their draws."""
    penalized = [(PROMPTS[1], SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=6, ignore_eos=True)),
                 (PROMPTS[2], SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=3, max_tokens=9,
                                             ignore_eos=True))]
    requests = GREEDY + SAMPLED[:1] + penalized
    expected = run_requests(_core(tiny, 1)[0], requests)
    multi, plans = _core(tiny, 4)
    assert run_requests(multi, requests) == expected
    penalized_ids = {f"r{len(requests) - 2}", f"r{len(requests) - 1}"}
    assert all(steps == 1 for steps, ids in plans if penalized_ids & set(ids))
    assert any(steps > 1 for steps, ids in plans)  # once they ended


def test_the_token_budget_bounds_a_runs_forwards(tiny):
    """A run's tokens (forwards times rows) stay within max_num_batched_tokens: a budget of 12 gives 5 rows runs of 2,
    4 rows runs of 3, and so on."""
    requests = [(prompt, _greedy(9, ignore_eos=True)) for prompt in PROMPTS]
    expected = run_requests(_core(tiny, 1, budget=64)[0], requests)
    multi, plans = _core(tiny, 8, budget=12)
    assert run_requests(multi, requests) == expected
    assert all(steps * len(ids) <= 12 for steps, ids in plans if steps > 1)
    assert any(steps > 1 for steps, _ in plans)


def test_preemption_and_prefix_hits_keep_the_tokens(tiny):
    """With too few blocks for every request a run cannot always take its slots: it falls back to one forward (no
    preemption for a run), requests are preempted and recomputed as usual, and a second round of the same prompts
    hits the prefix cache; every request's tokens are the one-step engine's."""
    requests = [(prompt, _greedy(24, ignore_eos=True)) for prompt in PROMPTS]
    one, _ = _core(tiny, 1, num_blocks=12)
    expected = run_requests(one, requests)
    assert one.scheduler.num_preemptions > 0
    multi, plans = _core(tiny, 4, num_blocks=12)
    assert run_requests(multi, requests) == expected
    assert multi.scheduler.num_preemptions > 0 and any(steps > 1 for steps, _ in plans)
    hits = multi.snapshot().prefix_cache_hit_tokens
    assert run_requests(multi, requests) == expected
    assert multi.snapshot().prefix_cache_hit_tokens > hits


def test_the_device_chooses_the_default():
    config = SchedulerConfig()
    assert config.num_scheduler_steps == 1
    assert config.for_device("cuda").num_scheduler_steps > 1
    assert SchedulerConfig(num_scheduler_steps=3).num_scheduler_steps == 3
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)


@pytest.mark.slow
@pytest.mark.parametrize("async_output_processing", [False, True])
def test_the_embedded_model_finishes_every_request_as_one_step_a_token_does(make_llm, async_output_processing):
    """The embedded model in bf16 with n-gram speculation (the CPU's defaults) and async output processing off and
    on (CUDA's): greedy requests that end on eos, on a stop string the front end finds inside a run, on max_tokens,
    beside a seeded sampled one, give the one-step engine's final text, tokens and finish."""
    one = make_llm(dtype="bfloat16", num_scheduler_steps=1)
    params = mixed_params(one)
    stop = params[1].stop[0]

    def finals(llm):
        return mixed_finals(llm, params)

    one_steps = one.engine.stats.num_steps
    expected = finals(one)
    one_steps = one.engine.stats.num_steps - one_steps
    assert expected[1][2:] == ("stop", stop)
    multi = make_llm(dtype="bfloat16", num_scheduler_steps=4, async_output_processing=async_output_processing)
    steps_before = multi.engine.stats.num_steps
    assert finals(multi) == expected
    pool = multi.engine.kv_cache.pool
    assert pool.num_owned_blocks() == 0
    assert multi.engine.stats.num_steps - steps_before < one_steps  # runs of forwards did happen


def _backends():
    backends = [CpuKernelBackend("cpu", torch.float32, 4, cpu_kernels.for_device(torch.device("cpu")))]
    try:
        from serval.layers.attention.triton_paged import TritonPagedBackend
    except ImportError:  # no triton: the CUDA path's backend is not here either
        return backends
    return backends + [TritonPagedBackend("cpu", torch.float32, 4)]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).__name__)
def test_a_backend_moves_decode_metadata_on_as_a_new_build_gives_it(backend):
    """advance_decodes, twice, on a padded decode batch's metadata (tables 6 blocks wide) equals build_metadata at
    the positions two on, for the rows that move (a row crossing into its next block among them); the padding row
    stays where it was."""
    blocks = [[7, 3, 9], [2], [5, 6, 1, 8], [11]]  # the last one: a padding row on block 11 at position 0
    starts = [6, 1, 11, 0]
    step = torch.tensor([1, 1, 1, 0])
    meta = backend.build_metadata([ScheduledSequence(b, p, 1) for b, p in zip(blocks, starts)], 6)
    for _ in range(2):
        backend.advance_decodes(meta, step)
    moved = [p + 2 * int(s) for p, s in zip(starts, step)]
    expected = backend.build_metadata([ScheduledSequence(b, p, 1) for b, p in zip(blocks, moved)], 6)
    for name, value in vars(expected).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(meta, name), value), name
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 2 * 4 + 3, 8 * 4 + 1, 11 * 4 + 0]


@pytest.mark.slow
def test_a_stop_string_inside_a_run_ends_the_tokens_where_one_step_a_token_does(make_llm):
    """A stop string completed by the middle token of a run of 4 (a request alone: runs of tokens 2-5, 6-9, ...):
    the output's tokens end with the one that completed it, as with one forward a step (usage counts them), and the
    text is cut before it."""
    one = make_llm(dtype="bfloat16", num_scheduler_steps=1)
    prompt = "Once upon a time, in a small village,"
    free = one.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    tokenizer = one.engine.tokenizer
    start = len(tokenizer.decode(tokens[:5]))
    stop = tokenizer.decode(tokens[:7])[start:]  # the 6th and 7th tokens' text: completed by the 7th, mid-run
    assert len(stop) >= 2 and free.outputs[0].text.find(stop) == start
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    expected = one.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert expected.token_ids == tokens[:7] and expected.finish_reason == "stop"
    multi = make_llm(dtype="bfloat16", num_scheduler_steps=4, async_output_processing=True)
    got = multi.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (expected.text, expected.token_ids, "stop", stop)
