"""Long prompts on the embedded model: time to first token, decode speed at that context, and memory, at 1k, 4k and
8k tokens (SmolLM2's whole context), through chunked prefill with the default token budget.

    .venv/bin/python benchmarks/bench_long_context.py [--lengths 1024,4096,8192] [--dtype auto] [--kv-cache-dtype int8]

The prompt is prose (the same paragraphs repeated, numbered so no two are alike); one request at a time, greedy,
speculation off (so the decode figure is the model's own step). Memory: the process's resident size before the
request and its largest value after any step of it (the KV cache is allocated up front, sized for the longest
prompt, so the growth is the steps' own working memory). Wall-clock numbers vary between sessions: compare within
one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from serval import LLMEngine, SamplingParams
from serval.config import CacheConfig, EngineConfig, SpeculativeConfig
from serval.platform_info import describe_hardware

PARAGRAPH = ("Section {i}. The harbour town woke slowly: fishing boats came back with the tide, the market opened "
             "its stalls of bread, cheese and fruit, and children ran along the sea wall on their way to school. ")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """The process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def prompt_of(engine: LLMEngine, num_tokens: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < num_tokens:
        ids += engine.tokenizer.encode(PARAGRAPH.format(i=i), add_special_tokens=False)
        i += 1
    return ids[:num_tokens]


def run(engine: LLMEngine, prompt: list[int], max_tokens: int) -> dict:
    request_id = f"long-{len(prompt)}-{time.monotonic_ns()}"
    steps_before = engine.stats.num_steps
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first = last = None
    rss_start = rss_max = rss_mib()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        rss_max = max(rss_max, rss_mib())
        for out in outputs:
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids:
                first = first or now
                last = now
    generated = max_tokens
    return {"prompt_tokens": len(prompt), "ttft_s": round(first - start, 3),
            "prefill_tok_s": round(len(prompt) / (first - start), 1),
            "tpot_ms": round(1000 * (last - first) / max(1, generated - 1), 2),
            "steps": engine.stats.num_steps - steps_before, "rss_start_mib": round(rss_start, 1),
            "rss_max_during_mib": round(rss_max, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's elements (auto, int8, fp8_e4m3, ...)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the token budget (default: the engine's)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    print(f"machine: {describe_hardware()}", flush=True)
    rss_before = peak_rss_mib()
    # Room for the longest prompt and its answer, nothing more: the KV cache's size is part of the memory figure.
    longest = max(lengths) + args.output_tokens
    config = EngineConfig(dtype=args.dtype, max_model_len=longest, speculative=SpeculativeConfig(method=None),
                          cache=CacheConfig(num_blocks=-(-longest // 16) + 1, kv_cache_dtype=args.kv_cache_dtype))
    if args.max_num_batched_tokens:
        config.scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    print(f"[1/{len(lengths) + 1}] loading the engine ({args.dtype}) ...", flush=True)
    engine = LLMEngine(config)
    results = {"machine": describe_hardware(), "dtype": engine.config.dtype, "kv_cache_dtype": args.kv_cache_dtype,
               "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
               "kv_cache_blocks": engine.kv_cache.num_blocks, "rss_before_load_mib": round(rss_before, 1),
               "rss_after_load_mib": round(peak_rss_mib(), 1), "runs": []}
    run(engine, prompt_of(engine, 64), 4)  # warm-up
    for i, n in enumerate(lengths):
        print(f"[{i + 2}/{len(lengths) + 1}] a {n}-token prompt ...", flush=True)
        result = run(engine, prompt_of(engine, n), args.output_tokens)
        print(f"    TTFT {result['ttft_s']} s ({result['prefill_tok_s']} prompt tok/s), TPOT {result['tpot_ms']} ms "
              f"at that context, RSS {result['rss_start_mib']} -> at most {result['rss_max_during_mib']} MiB",
              flush=True)
        results["runs"].append(result)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
