"""`serval bench quality`: what each weight form costs in quality, measured through the engine itself.

For each form (dtype + quantization, and optionally the activation quantization and the block kernel's dot
products, e.g. bfloat16:gguf:none:fma) of one model: the perplexity of a
fixed English text that ships with Python itself (the library reference topics in ``pydoc_data.topics``: every
machine has the same bytes), scored in windows through prompt logprobs, and the greedy agreement of seeded prose
continuations with the reference form (float32, dequantized: the file's weights at full precision). Lower perplexity
is better; agreement is the share of continuations identical token for token, and the mean share of tokens before
the first difference.

    serval bench quality [--forms float32:none,bfloat16:gguf,bfloat16:gguf:int8] [--num-tokens 4096] [--window 512]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

from serval.benchmark.workloads import prose

REFERENCE_FORM = "float32:none"
DEFAULT_FORMS = "float32:none,bfloat16:none,float32:gguf,bfloat16:gguf,bfloat16:int8"


def reference_text() -> str:
    """The text scored: Python's own library reference topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of ``window`` tokens (the last may be shorter; one of fewer than 2 tokens scores
    nothing and is dropped)."""
    return [token_ids[i: i + window] for i in range(0, len(token_ids), window) if len(token_ids[i: i + window]) > 1]


def perplexity(llm, chunks: list[list[int]]) -> tuple[float, int]:
    """(perplexity, tokens scored): exp of the mean negative log-likelihood of every token after each window's
    first, under the engine's prompt logprobs."""
    from serval.sampling_params import SamplingParams

    outputs = llm.generate(chunks, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    logprobs = [entry.logprob for out in outputs for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def continuations(llm, prompts: list[str], num_tokens: int) -> list[list[int]]:
    from serval.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefixes = []
    for a, b in zip(reference, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same / max(1, len(a)))
    return {"identical": sum(p == 1.0 for p in prefixes) / len(prefixes),
            "mean_prefix_share": sum(prefixes) / len(prefixes)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="embedded model name, .gguf file or HF directory")
    parser.add_argument("--forms", default=DEFAULT_FORMS,
                        help=f"dtype:quantization pairs, comma-separated, each with an optional third field, the "
                        f"activation quantization (bfloat16:gguf:int8); {REFERENCE_FORM} is the reference and is "
                        "always measured")
    parser.add_argument("--num-tokens", type=int, default=4096, help="tokens of the text scored")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window (each starts afresh)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prose prompts continued greedily")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens per greedy continuation")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prose prompts")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from serval.engine.llm import LLM
    from serval.model.loader import resolve_quantization
    from serval.platform_info import describe_hardware

    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    forms = [REFERENCE_FORM] + [f for f in forms if f != REFERENCE_FORM]
    rng = random.Random(args.seed)
    prompts = [prose(rng, rng.randint(10, 40)) for _ in range(args.num_prompts)]
    machine = describe_hardware()
    print(f"machine: {machine}", flush=True)
    results: dict = {"machine": machine, "text": "pydoc_data.topics (Python's library reference topics)",
                     "num_tokens": args.num_tokens, "window": args.window, "num_prompts": args.num_prompts,
                     "output_tokens": args.output_tokens, "reference": REFERENCE_FORM, "forms": {}}
    reference_tokens = None
    print(f"{'form':<18}{'weights':>8}{'perplexity':>12}{'vs ref':>9}{'identical':>11}{'prefix':>9}{'s':>7}")
    for form in forms:
        # A third field: EngineConfig.activation_quantization; a fourth: EngineConfig.block_dot_products
        dtype, quantization, *kernel = form.split(":")
        start = time.perf_counter()
        llm = LLM(args.model, dtype=dtype, quantization=quantization, max_model_len=max(args.window, 1024),
                  activation_quantization=kernel[0] if kernel else "none",
                  block_dot_products=kernel[1] if len(kernel) > 1 else "auto")
        text_ids = llm.tokenizer.encode(reference_text())[: args.num_tokens]
        ppl, scored = perplexity(llm, windows(text_ids, args.window))
        tokens = continuations(llm, prompts, args.output_tokens)
        engine = llm.engine
        weights = resolve_quantization(engine.model_path, engine.config.device, engine.config.torch_dtype,
                                       quantization)
        entry = {"dtype": dtype, "quantization": weights,
                 "activation_quantization": engine.config.activation_quantization,
                 "block_dot_products": engine.core.dot_products, "perplexity": ppl,
                 "tokens_scored": scored,
                 "seconds": time.perf_counter() - start}
        if reference_tokens is None:
            reference_tokens, results["model"] = tokens, str(engine.model_path)
        entry.update(agreement(reference_tokens, tokens))
        reference_ppl = results["forms"].get(REFERENCE_FORM, entry)["perplexity"]
        entry["perplexity_vs_reference"] = ppl / reference_ppl
        results["forms"][form] = entry
        print(f"{form:<18}{weights:>8}{ppl:>12.3f}{entry['perplexity_vs_reference']:>9.4f}"
              f"{entry['identical']:>11.2f}{entry['mean_prefix_share']:>9.2f}{entry['seconds']:>7.1f}", flush=True)
        del llm, engine
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0
