"""Structured outputs: the sampler's batch bitmask; every output of a constrained request parses and validates
(several schemas, greedy and sampled, in the default dtype); regex, choice, grammar and json_object; constrained and
free requests share batches without changing each other; speculation keeps a constrained output identical; a bad
grammar is refused alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from real_model import requires_model

from serval import SamplingParams
from serval.config import EngineConfig
from serval.engine.messages import EngineCoreRequest
from serval.layers import sampler as sampler_module
from serval.layers.sampler import Sampler, SamplingRow, apply_token_bitmask
from serval.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "address"],
}
INVENTORY = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 8},
                           "price": {"type": "number", "minimum": 0.5, "maximum": 99.5},
                           "in_stock": {"type": "boolean"}},
            "required": ["sku", "price", "in_stock"]}},
        "currency": {"enum": ["EUR", "USD"]},
    },
    "required": ["items", "currency"],
}
SCORES = {"type": "array", "minItems": 2, "maxItems": 4,
          "items": {"type": "integer", "minimum": -5, "maximum": 5}}
SCHEMAS = [PERSON, INVENTORY, SCORES]


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_token_bitmask_masks_exactly_the_refused_tokens_of_the_constrained_rows(path, monkeypatch):
    if path == "torch":  # the path other devices take: a broadcast shift in torch
        monkeypatch.setattr(sampler_module.sys, "byteorder", "big")
    torch.manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(3, vocab)
    allowed_ids = [[5, 31, 32, 99], [0, 64]]
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for row, ids in enumerate(allowed_ids):
        for token in ids:
            bitmask[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)  # bit 31: the sign bit
    masked = apply_token_bitmask(logits, [0, 2], bitmask)
    assert torch.equal(masked[1], logits[1])  # the free row is untouched
    for row, ids in zip([0, 2], allowed_ids):
        finite = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert finite == ids
        assert torch.equal(masked[row, ids], logits[row, ids])
    assert torch.isfinite(logits).all()  # the input is not written
    every_row = apply_token_bitmask(logits[[0, 2]], [0, 1], bitmask)
    assert torch.equal(every_row, masked[[0, 2]])

    params = SamplingParams(temperature=0)
    rows = [SamplingRow(params, [1], [], None, []) for _ in range(3)]
    picked = Sampler()(logits, rows, ([0, 2], bitmask)).token_ids
    assert picked[0] == max(allowed_ids[0], key=lambda t: logits[0, t])
    assert picked[1] == int(logits[1].argmax())
    assert picked[2] == max(allowed_ids[1], key=lambda t: logits[2, t])


@pytest.fixture(scope="module")
def engines(make_llm):
    """(without speculation, with speculation at any batch size) in the dtype users get on this machine."""
    dtype = str(EngineConfig().torch_dtype).removeprefix("torch.")
    return (make_llm(dtype=dtype, speculative_model=None),
            make_llm(dtype=dtype, speculative_model="ngram", speculative_max_batch_size=64))


def _chat(llm, text: str) -> str:
    return llm.engine.tokenizer.render_chat([{"role": "user", "content": text}])


@pytest.mark.slow
@requires_model
def test_every_schema_constrained_output_parses_and_validates_greedy_and_sampled(engines):
    plain, spec = engines
    prompts, params = [], []
    for schema in SCHEMAS:
        prompt = _chat(plain, "Reply with JSON for this schema: " + json.dumps(schema))
        for i in range(3):  # greedy, then two seeded samples
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0 if i == 0 else 1.0, seed=i, max_tokens=160,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    for llm in (plain, spec):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMAS[i // 3])


@pytest.mark.slow
@requires_model
def test_regex_choice_grammar_and_json_object_outputs_follow_them(engines):
    plain, _ = engines
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "it \"depends\""]), lambda t: t in ("yes", "no",
                                                                                          'it "depends"')),
        (StructuredOutputsParams(grammar='root ::= "Answer: " ("A" | "B" | "C") "."'),
         lambda t: re.fullmatch(r"Answer: [ABC]\.", t)),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    prompt = _chat(plain, 'Reply with a JSON object with the key "answer": is the sky blue?')
    for spec, check in cases:
        for temperature in (0, 1.0):
            params = SamplingParams(temperature=temperature, seed=1, max_tokens=160, structured_outputs=spec)
            completion = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert completion.finish_reason == "stop" and check(completion.text), (spec, completion.text)


@pytest.mark.slow
@requires_model
def test_constrained_and_free_requests_share_a_batch_without_changing_each_other(engines):
    plain, spec = engines
    free_prompts = ["The three primary colors are", _chat(plain, "Tell me about cats.")]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in plain.generate(free_prompts, free, use_tqdm=False)]
    constrained = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=s))
                   for s in SCHEMAS]
    json_prompt = _chat(plain, "Give me some JSON.")
    constrained_alone = [plain.generate([json_prompt], p, use_tqdm=False)[0].outputs[0].token_ids
                         for p in constrained]
    for llm in (plain, spec):  # speculation checks guesses against the grammar: the output must not move
        mixed = llm.generate(free_prompts + [json_prompt] * 3, [free, free] + constrained, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
        assert [o.outputs[0].token_ids for o in mixed[2:]] == constrained_alone


@pytest.mark.slow
@requires_model
def test_guesses_the_grammar_refuses_are_never_proposed(engines):
    _, spec = engines
    core = spec.engine.core
    tokenizer = spec.engine.tokenizer
    core.grammars.manager().submit("probe", StructuredOutputsParams(regex=r"ab+c"))  # on a compile thread
    core.grammars.structured.wait_compiled(timeout=60)
    assert core.grammars.structured.take_compiled() == (["probe"], {})
    a, b, c, x = (tokenizer.encode(t, add_special_tokens=False) for t in ("a", "b", "c", "x"))
    assert core.grammars.structured.valid_prefix("probe", a + b + b + c) == a + b + b + c
    assert core.grammars.structured.valid_prefix("probe", a + b + x + c) == a + b
    assert core.grammars.structured.valid_prefix("probe", x) == []
    # A row per position: before a, after a, after ab.
    masks, errors = core.grammars.structured.bitmasks({"probe": a + b})
    assert errors == {}
    allowed = [{t for t in range(64, 128) if masks["probe"][row, t // 32] >> (t % 32) & 1} for row in range(3)]
    assert a[0] in allowed[0] and b[0] not in allowed[0]
    assert b[0] in allowed[1] and c[0] not in allowed[1]
    assert c[0] in allowed[2] and b[0] in allowed[2]
    assert core.grammars.structured.valid_prefix("probe", a + b + b + c) == a + b + b + c  # the matcher was rolled back
    eos = sorted(tokenizer.eos_token_ids)[0]
    guesses = core.grammars.structured.valid_prefix("probe", a + b + c + [eos] + a)  # nothing follows the stop token
    assert guesses == a + b + c + [eos]
    masks, errors = core.grammars.structured.bitmasks({"probe": guesses})  # the row after the stop token is not filled
    assert errors == {} and masks["probe"].shape[0] == len(guesses) + 1 and bool((masks["probe"][-1] == -1).all())
    core.grammars.structured.remove("probe")


@pytest.mark.slow
@requires_model
def test_a_bad_grammar_is_refused_with_its_reason_and_disturbs_nothing(engines):
    plain, _ = engines
    engine = plain.engine
    cases = [(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
              "frobnicate"),
             (StructuredOutputsParams(json="{not json"), "Failed to parse JSON"),
             (StructuredOutputsParams(regex="(ab"), "parenthesis is not closed"),
             (StructuredOutputsParams(grammar="root ::= missing"), 'Rule "missing" is not defined')]
    engine.add_request("good", "The three primary colors are", SamplingParams(temperature=0, max_tokens=8))
    for spec, reason in cases:
        with pytest.raises(ValueError, match="invalid structured output") as info:
            engine.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
        assert reason in str(info.value)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    # A bad grammar that reaches the core directly fails that request alone.
    engine.core.add_request(EngineCoreRequest("bad-core", [1, 2, 3], SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="(ab")), [], 8))
    finished = {}
    while engine.core.has_unfinished_requests():
        for out in engine.core.step().outputs:
            if out.finish_reason:
                finished[out.request_id] = out
    engine.outputs.groups.clear()
    assert finished["bad-core"].finish_reason == "error" and "parenthesis" in finished["bad-core"].error
    assert finished["good"].finish_reason == "length" and len(finished["good"].new_token_ids) >= 1
    assert engine.kv_cache.pool.num_free_blocks == engine.core.stats.num_blocks


@pytest.mark.slow
@requires_model
def test_a_finished_grammar_ends_a_request_that_ignores_eos(engines):
    plain, _ = engines
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green"]))
    completion = plain.generate([_chat(plain, "Pick a color.")], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.text in ("red", "green")


@pytest.mark.slow
@requires_model
def test_a_grammar_compiles_off_the_step_loop_and_one_past_the_time_limit_fails_alone(engines, monkeypatch):
    """1,500 optional properties take a second or more to compile: the free request beside it runs to its end
    meanwhile, and with the limit at 50 ms the grammar's request fails alone with an error naming the limit."""
    plain, _ = engines
    engine = plain.engine
    engine.add_request("warm", "Hi", SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
        choice=["yes"])))  # sets up the compiler
    while engine.has_unfinished_requests():
        engine.step()
    monkeypatch.setattr(engine.core.grammars.structured, "compile_timeout_s", 0.05)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(1_500)}}
    engine.add_request("slow", "Hello", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json=schema)))
    engine.add_request("free", "The three primary colors are", SamplingParams(temperature=0, max_tokens=8,
                                                                              ignore_eos=True))
    assert engine.core.snapshot().num_waiting == 2  # a request whose grammar compiles is waiting
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["slow"].outputs[0].finish_reason == "error"
    assert "took longer than 0.05 s to compile" in finished["slow"].error
    assert finished["slow"].error.startswith("invalid structured output json")
    assert len(finished["free"].outputs[0].token_ids) == 8
    assert engine.core.snapshot().num_waiting == 0
    assert engine.kv_cache.pool.num_free_blocks == engine.core.stats.num_blocks


def test_the_first_grammar_makes_the_compiler_on_a_thread_not_on_the_step_loop(monkeypatch):
    """Before any idle time prepared it, the first grammar's xgrammar import and compiler (0.7 s and more) happen on
    a thread: the step loop's submit returns at once and its steps go on (a stream stood still 0.88 s without)."""
    import threading

    from serval.engine import grammar_scheduler, structured_output
    from serval.engine.request import Request

    made_on, started, release = [], threading.Event(), threading.Event()

    class SlowManager:
        def __init__(self, *args) -> None:
            made_on.append(threading.current_thread().name)
            started.set()
            release.wait(10)  # an import that takes its time
            self.submitted = []

        def submit(self, request_id, spec) -> None:
            self.submitted.append(request_id)

        def prepare(self) -> None:
            pass

        def take_compiled(self):
            return list(self.submitted), {}

        def wait_compiled(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(structured_output, "StructuredOutputManager", SlowManager)
    grammars = grammar_scheduler.GrammarScheduler("unused", 100, 30.0)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    request = Request("r1", [1, 2], params)
    grammars.submit(request)  # returns while the manager is still being made
    assert started.wait(10) and made_on[0] != threading.current_thread().name
    assert grammars.take_compiled(wait=False) == ([], {})
    release.set()
    assert grammars._made.wait(10)
    ready, failed = grammars.take_compiled(wait=True)
    assert ready == [request] and failed == {} and not grammars.waiting
