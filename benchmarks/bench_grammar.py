"""Structured outputs' costs on the embedded model's tokenizer: the grammar engines side by side, then the engine.

1. xgrammar (what Serval uses) and llguidance (if installed: `pip install llguidance==1.9.1`): setup (the
   tokenizer's byte table), compile time per JSON schema, and mask time per token with 16 requests in the batch
   (each advancing through a valid answer of its own schema).
2. The engine, offline, in its default configuration without speculation: tokens/s of greedy generation at 1
   and 16 requests, free and constrained by a JSON schema.

    .venv/bin/python benchmarks/bench_grammar.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serval.platform_info import describe_hardware  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]}}, "required": ["name", "age", "role", "address"]},
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "price": {"type": "number", "minimum": 0}, "in_stock": {"type": "boolean"}},
            "required": ["sku", "price", "in_stock"]}}, "currency": {"enum": ["EUR", "USD"]}},
     "required": ["items", "currency"]},
    {"type": "array", "maxItems": 8, "items": {"type": "integer", "minimum": -5, "maximum": 5}},
]
ANSWERS = [
    {"name": "Ada Lovelace", "age": 36, "role": "admin", "address": {"city": "London", "zip": "W1A 1AA"}},
    {"items": [{"sku": "A-100", "price": 9.5, "in_stock": True}, {"sku": "B-7", "price": 120, "in_stock": False}],
     "currency": "EUR"},
    [1, -2, 3, 0, 5, -5, 4, 2],
]
BATCH = 16


def main() -> None:
    from serval.model.registry import resolve_model_path
    from serval.tokenizer import Tokenizer

    print(f"machine: {describe_hardware()}", flush=True)
    tokenizer = Tokenizer.load(resolve_model_path(None))
    vocab = 49152
    answers = [tokenizer.encode(json.dumps(a), add_special_tokens=False) for a in ANSWERS]
    print(f"\nGrammar engines: {len(SCHEMAS)} schemas, mask per token at batch {BATCH} "
          f"({sum(len(a) for a in answers)} answer tokens)")
    print(f"{'engine':<12} {'setup ms':>9} {'compile ms (each schema)':>26} {'mask us p50':>12} {'p90':>8}")
    report("xgrammar", *bench_xgrammar(tokenizer, vocab, answers))
    try:
        report("llguidance", *bench_llguidance(tokenizer, vocab, answers))
    except ImportError:
        print("llguidance  (not installed: pip install llguidance==1.9.1 to compare)")
    bench_engine()


def report(name, setup_s, compile_s, mask_s) -> None:
    compiles = " ".join(f"{c * 1e3:.1f}" for c in compile_s)
    q = statistics.quantiles(mask_s, n=10)
    print(f"{name:<12} {setup_s * 1e3:>9.0f} {compiles:>26} {statistics.median(mask_s) * 1e6:>12.0f} "
          f"{q[8] * 1e6:>8.0f}")


def bench_xgrammar(tokenizer, vocab, answers):
    import xgrammar as xgr

    from serval.engine.structured_output import JSON_SEPARATORS

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf_tokenizer, vocab_size=vocab,
                                              stop_token_ids=sorted(tokenizer.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - start
    compiled, compile_s = [], []
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=JSON_SEPARATORS))
        compile_s.append(time.perf_counter() - start)
    matchers = [xgr.GrammarMatcher(compiled[i % len(SCHEMAS)]) for i in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab)
    mask_s = time_masks(matchers, answers, lambda m, i: m.fill_next_token_bitmask(bitmask, i),
                        lambda m, token: m.accept_token(token))
    return setup, compile_s, mask_s


def bench_llguidance(tokenizer, vocab, answers):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start
    grammars, compile_s = [], []
    for schema in SCHEMAS:
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(lltokenizer, grammar)
        compile_s.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        grammars.append(grammar)
    matchers = [llguidance.LLMatcher(lltokenizer, grammars[i % len(SCHEMAS)]) for i in range(BATCH)]
    bitmask = llguidance.torch.allocate_token_bitmask(BATCH, vocab)
    mask_s = time_masks(matchers, answers, lambda m, i: llguidance.torch.fill_next_token_bitmask(m, bitmask, i),
                        lambda m, token: m.consume_token(token))
    return setup, compile_s, mask_s


def time_masks(matchers, answers, fill, accept) -> list[float]:
    """Seconds of each mask fill, the batch's matchers advancing a token at a time through their answers."""
    mask_s = []
    for step in range(max(len(a) for a in answers)):
        for i, matcher in enumerate(matchers):
            tokens = answers[i % len(answers)]
            if step < len(tokens):
                start = time.perf_counter()
                fill(matcher, i)
                mask_s.append(time.perf_counter() - start)
                assert accept(matcher, tokens[step])
    return mask_s


def bench_engine() -> None:
    from serval import LLM, SamplingParams
    from serval.sampling_params import StructuredOutputsParams

    # Speculation off: its gain depends on what the text repeats, which a grammar changes; with one token per
    # request per step, the two rates compare the cost of a step.
    llm = LLM(speculative_model=None)
    chat = [llm.engine.tokenizer.render_chat([{"role": "user", "content": f"Describe person number {i} as JSON."}])
            for i in range(BATCH)]
    print(f"\nEngine, offline, default configuration but no speculation (dtype {llm.engine.config.dtype}), greedy, "
          "64 tokens each, median of 3")
    print(f"{'requests':>8} {'free tok/s':>11} {'JSON schema tok/s':>18} {'ratio':>6}")
    llm.generate(chat[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm up
    # The schema's one string must be longer than 64 tokens can write: constrained requests run as long as free
    # ones (ignore_eos), so the two rates count the same tokens.
    notes = StructuredOutputsParams(json={"type": "object", "properties": {"notes": {"type": "string",
                                                                                     "minLength": 1000}},
                                          "required": ["notes"]})
    for batch in (1, BATCH):
        rates: list[list[float]] = [[], []]
        for _ in range(3):  # alternated and repeated: one run of each moves by 10% from noise alone
            for which, so in enumerate((None, notes)):
                params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, structured_outputs=so)
                start = time.perf_counter()
                outputs = llm.generate(chat[:batch], params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                rates[which].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        rates = [statistics.median(r) for r in rates]
        print(f"{batch:>8} {rates[0]:>11.1f} {rates[1]:>18.1f} {rates[1] / rates[0]:>6.2f}")


if __name__ == "__main__":
    main()
