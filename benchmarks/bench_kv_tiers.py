"""The KV cache's second tier on the embedded model, offline, in one run:

1. shared prefixes that do not fit the KV cache: P long system prompts, questions round-robin over them, one request
   at a time, with a KV cache that holds about two of them; TTFT and prompt tokens found cached, with one tier
   and with a host-RAM second tier;
2. a restart: the same prefixes asked once by a first engine with a disk tier, which is shut down; a second engine
   on that directory asks again; TTFT against an engine without the tier (cold);
3. preemption: 16 concurrent requests in a KV cache that holds about a third of them, preempted by recompute and by
   swap; wall time, tokens computed, output tokens/s, and whether the answers equal those of a cache that never
   preempted.

    .venv/bin/python benchmarks/bench_kv_tiers.py [--dtype auto] [--json FILE]

Greedy, speculation off (so every figure is the model's own steps). Wall-clock numbers vary between sessions:
compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from serval import LLMEngine, SamplingParams
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.runner import kv_cache_block_bytes
from serval.platform_info import describe_hardware

SYSTEM = ("You are the assistant of harbour office number {p}. Rules: answer briefly, name the quay, give tide times "
          "in 24-hour form, refer storms to the coast guard, and never promise a berth. ") * 6
QUESTIONS = ["When is high tide tomorrow?", "Where can I buy fuel?", "Is the north quay open?",
             "Who do I call in a storm?"]


def make_engine(args, model, tokenizer, num_blocks: int, **cache) -> LLMEngine:
    scheduler = cache.pop("scheduler", SchedulerConfig())
    config = EngineConfig(dtype=args.dtype, speculative=SpeculativeConfig(method=None), scheduler=scheduler,
                          cache=CacheConfig(num_blocks=num_blocks, **cache))
    return LLMEngine(config, model=model, tokenizer=tokenizer)


def ask(engine: LLMEngine, prompt: list[int], max_tokens: int = 8) -> tuple[float, int]:
    """(TTFT in seconds, prompt tokens found cached) of one request alone."""
    request_id = f"q-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    ttft, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
                cached = out.num_cached_tokens
    return ttft, cached


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": round(1000 * statistics.median(ordered), 1),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 1)}


def prompts(engine: LLMEngine, num_prefixes: int) -> list[list[int]]:
    """Questions round-robin over the prefixes (the order in which they are asked)."""
    return [engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM.format(p=p)},
                                                  {"role": "user", "content": q}])
            for q in QUESTIONS for p in range(num_prefixes)]


def shared_prefixes(args, model, tokenizer, block_bytes: int) -> dict:
    results = {}
    for name, cache in (("one tier", {}), ("host second tier", {"kv_offload_size": args.offload_gib})):
        engine = make_engine(args, model, tokenizer, args.small_blocks, **cache)
        asked = prompts(engine, args.prefixes)
        ttfts, cached, total = [], 0, 0
        for prompt in asked:
            ttft, hit = ask(engine, prompt)
            ttfts.append(ttft)
            cached, total = cached + hit, total + len(prompt)
        results[name] = {"requests": len(asked), "prompt_tokens": total, "cached_tokens": cached,
                         "cached_share": round(cached / total, 3), **percentiles(ttfts),
                         "tier_blocks": engine.kv_cache.offload.num_slots if engine.kv_cache.offload else 0}
        print(f"    {name}: TTFT p50 {results[name]['p50_ms']} ms, p90 {results[name]['p90_ms']} ms, "
              f"{100 * results[name]['cached_share']:.1f}% of prompt tokens cached", flush=True)
    results["kv_cache_blocks"] = args.small_blocks
    results["tier_capacity_tokens"] = int(args.offload_gib * 2**30 // block_bytes) * 16
    return results


def restart(args, model, tokenizer) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        tier = {"kv_offload_size": args.offload_gib, "kv_offload_path": directory}
        first = make_engine(args, model, tokenizer, args.small_blocks, **tier)
        asked = prompts(first, args.prefixes)[: args.prefixes]  # one question per prefix
        for prompt in asked:
            ask(first, prompt)
        start = time.perf_counter()
        first.shutdown()
        shutdown_s = time.perf_counter() - start
        results = {"shutdown_save_s": round(shutdown_s, 3)}
        for name, cache in (("cold, no tier", {}), ("restarted on the disk tier", tier)):
            engine = make_engine(args, model, tokenizer, args.small_blocks, **cache)
            runs = [ask(engine, prompt) for prompt in asked]
            results[name] = {**percentiles([t for t, _ in runs]), "cached_tokens": sum(c for _, c in runs)}
            print(f"    {name}: TTFT p50 {results[name]['p50_ms']} ms, {results[name]['cached_tokens']} prompt "
                  "tokens cached", flush=True)
            engine.shutdown()
        return results


def preemption(args, model, tokenizer) -> dict:
    stories = [f"Story {i}: once upon a time in a land far away, there lived a" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    results, answers = {}, {}
    runs = (("never preempted", 2048, {}),
            ("recompute", args.tight_blocks, {"scheduler": SchedulerConfig(preemption_mode="recompute")}),
            ("swap", args.tight_blocks, {"kv_offload_size": args.offload_gib,
                                         "scheduler": SchedulerConfig(preemption_mode="swap")}))
    for name, blocks, cache in runs:
        engine = make_engine(args, model, tokenizer, blocks, **cache)
        for i, story in enumerate(stories):
            engine.add_request(f"s{i}", story, params)
        start = time.perf_counter()
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        wall = time.perf_counter() - start
        answers[name] = [outputs[f"s{i}"] for i in range(16)]
        stats = engine.stats
        results[name] = {"kv_cache_blocks": blocks, "wall_s": round(wall, 2),
                         "output_tok_s": round(16 * args.output_tokens / wall, 1),
                         "tokens_computed": stats.num_scheduled_tokens, "preemptions": stats.num_preemptions,
                         "swaps": engine.scheduler.num_swaps,
                         "same_answers_as_never_preempted": answers[name] == answers["never preempted"]}
        print(f"    {name}: {results[name]}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefixes", type=int, default=6, help="distinct system prompts (about 190 tokens each)")
    parser.add_argument("--small-blocks", type=int, default=32, help="KV cache blocks in parts 1 and 2")
    parser.add_argument("--tight-blocks", type=int, default=80, help="KV cache blocks in part 3")
    parser.add_argument("--offload-gib", type=float, default=0.25, help="the second tier's size")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    print(f"machine: {describe_hardware()}", flush=True)
    print("[1/4] loading the engine ...", flush=True)
    loaded = LLMEngine(EngineConfig(dtype=args.dtype, speculative=SpeculativeConfig(method=None)))
    model, tokenizer = loaded.model, loaded.tokenizer
    args.dtype = loaded.config.dtype
    block_bytes = kv_cache_block_bytes(model.config, 16, loaded.config.torch_dtype)
    ask(loaded, tokenizer.encode("Warm up the kernels."))  # builds and warms the kernels
    del loaded
    results = {"machine": describe_hardware(), "dtype": args.dtype, "block_bytes": block_bytes}
    print(f"[2/4] shared prefixes over a {args.small_blocks}-block KV cache ...", flush=True)
    results["shared_prefixes"] = shared_prefixes(args, model, tokenizer, block_bytes)
    print("[3/4] a restart on a disk tier ...", flush=True)
    results["restart"] = restart(args, model, tokenizer)
    print(f"[4/4] 16 requests in a {args.tight_blocks}-block KV cache: recompute against swap ...", flush=True)
    results["preemption"] = preemption(args, model, tokenizer)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
