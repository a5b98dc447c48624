"""The runner's greedy fast path (engine/runner.py): a step whose rows all take the argmax only skips the per-row
sampler, and gives the tokens the sampler gives; any other row sends the whole step through the sampler."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.engine.request import Request
from serval.engine.runner import ModelRunner
from serval.engine.scheduler import SchedulerOutput
from serval.model.loader import load_model

PROMPTS = [list(range(10, 10 + n)) for n in (5, 17, 30, 9)]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Rows that need the sampler, each beside the greedy ones, and at how many steps: every one's, but a min_tokens row
# only while its eos and stop ids are blocked.
OTHERS = [(SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True), MAX_TOKENS),
          (SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=MAX_TOKENS,
                          ignore_eos=True), MAX_TOKENS),
          (SamplingParams(temperature=0, logprobs=2, max_tokens=MAX_TOKENS, ignore_eos=True), MAX_TOKENS),
          (SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[0, 1], max_tokens=MAX_TOKENS), 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=3).save_pretrained(path, safe_serialization=True)
    return path, load_model(path, torch.float32)


def _core(tiny, **config) -> tuple[EngineCore, list[int]]:
    """An engine core on the tiny model, and a list that gets each sampler call's row count."""
    path, model = tiny
    core = EngineCore(EngineConfig(dtype="float32", max_model_len=128, speculative=SpeculativeConfig(method=None),
                                   cache=CacheConfig(block_size=16, num_blocks=64), **config), path, model)
    calls, sampler = [], core.runner.sampler
    core.runner.sampler = lambda logits, rows, allowed=None: calls.append(len(rows)) or sampler(logits, rows, allowed)
    return core, calls


def _run(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], list]]:
    for i, (prompt, params) in enumerate(requests):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, [2], MAX_TOKENS))
    outputs: dict[str, tuple[list[int], list]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens, logprobs = outputs.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
    return outputs


@pytest.mark.parametrize("pad_decode_on_cpu", [False, True])
def test_an_all_greedy_batch_skips_the_sampler_and_gives_its_tokens(tiny, pad_decode_on_cpu):
    """Greedy requests alone never call the sampler; the same batch with the fast path turned off goes through the
    sampler at every step and gives the same tokens."""
    greedy = [(prompt, GREEDY) for prompt in PROMPTS]
    core, calls = _core(tiny, pad_decode_on_cpu=pad_decode_on_cpu)
    fast = _run(core, greedy)
    assert calls == [] and all(len(tokens) == MAX_TOKENS for tokens, _ in fast.values())
    core, calls = _core(tiny, pad_decode_on_cpu=pad_decode_on_cpu)
    core.runner._takes_argmax_only = lambda request: False
    assert _run(core, greedy) == fast and len(calls) >= MAX_TOKENS


@pytest.mark.parametrize(("other", "sampled_steps"), OTHERS, ids=["seeded", "penalized", "logprobs", "min_tokens"])
def test_a_row_that_needs_the_sampler_sends_the_step_through_it_and_greedy_rows_keep_their_tokens(tiny, other,
                                                                                                   sampled_steps):
    """Beside a seeded, a penalized, a logprobs or a min_tokens row, the greedy rows' tokens are those of the fast
    path alone, and the other row's tokens and logprobs are those it gets alone (through the sampler)."""
    greedy = [(prompt, GREEDY) for prompt in PROMPTS]
    alone_core, _ = _core(tiny)
    alone = _run(alone_core, greedy)
    other_core, other_calls = _core(tiny)
    other_alone = _run(other_core, [(PROMPTS[1], other)])["r0"]
    assert other_calls == [1] * sampled_steps  # the prefill's step included
    core, calls = _core(tiny)
    mixed = _run(core, greedy + [(PROMPTS[1], other)])
    assert calls == [len(PROMPTS) + 1] * sampled_steps  # the whole step, its greedy rows too
    assert {rid: mixed[rid] for rid in alone} == alone
    assert mixed[f"r{len(PROMPTS)}"] == other_alone
    if other.logprobs is not None:  # the logprobs row's tokens are greedy: those of its prompt's greedy row
        tokens, logprobs = other_alone
        assert tokens == alone["r1"][0] and [lp.token_id for lp in logprobs] == tokens


def _request(request_id: str, prompt: list[int], outputs: list[int], computed: int, **params) -> Request:
    request = Request(request_id, prompt, SamplingParams(temperature=0, **params), max_tokens=MAX_TOKENS)
    request.output_token_ids, request.num_computed_tokens = list(outputs), computed
    request.block_ids = [3 + len(prompt), 1 + len(outputs)]
    return request


def _fields(inputs) -> tuple:
    return (inputs.input_ids.tolist(), inputs.positions.tolist(), inputs.meta is None, inputs.seqs, inputs.rows,
            [r.request_id for r in inputs.sampling_requests], inputs.guesses, inputs.logits_indices,
            [(r.request_id, row, n) for r, row, n in inputs.scored])


@pytest.mark.parametrize("pad_decode_on_cpu", [False, True])
def test_a_decode_only_step_gets_the_inputs_of_the_general_path(tiny, pad_decode_on_cpu):
    """The decode-only shortcut of prepare_inputs builds what the general path builds (token ids, positions, rows,
    sampling rows, sequences; with the padded path, no metadata), for decodes right after their prompt and later
    ones; steps it must not take (a one-token chunk of a prompt, which samples nothing, or guesses) go the general
    way."""
    core, _ = _core(tiny, pad_decode_on_cpu=pad_decode_on_cpu)
    runner = core.runner
    general = ModelRunner.prepare_inputs.__get__(runner)

    def without_shortcut(out):
        runner._decode_only_inputs = lambda out: None
        try:
            return general(out)
        finally:
            del runner._decode_only_inputs

    decodes = [_request("a", [5, 6, 7], [], 2, prompt_logprobs=1), _request("b", [8, 9], [11, 12, 13], 4),
               _request("c", list(range(20)), [4], 20, logprobs=1)]
    out = SchedulerOutput(decodes, {r.request_id: 1 for r in decodes})
    assert runner._decode_only_inputs(out) is not None
    assert _fields(runner.prepare_inputs(out)) == _fields(without_shortcut(out))
    assert _fields(runner.prepare_inputs(out))[:2] == ([7, 13, 4], [2, 4, 20])
    chunk = _request("d", list(range(9)), [], 4, prompt_logprobs=0)  # one token of its prompt, scored
    out = SchedulerOutput(decodes + [chunk], {r.request_id: 1 for r in decodes + [chunk]})
    assert runner._decode_only_inputs(out) is None and _fields(runner.prepare_inputs(out))[-1] == [("d", 3, 1)]
    guessing = SchedulerOutput(decodes[1:], {"b": 3, "c": 1}, spec_token_ids={"b": [1, 2]})
    assert runner._decode_only_inputs(guessing) is None
