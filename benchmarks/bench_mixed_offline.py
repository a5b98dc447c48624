"""run_peers.py's mixed workload (MIXED: 64 requests, 20-600 words in, 16-128 tokens out, seed 3) offline at its
concurrency, 16: a new request is added as one finishes, greedy, speculation off. Wall time, engine steps, and with
--parts the main thread's CPU seconds in each part of the model (bench_step_cost.py's parts; they need
--enforce-eager, where each kernel is called from Python).

    .venv/bin/python benchmarks/bench_mixed_offline.py [--threads 2] [--enforce-eager --parts] [--model F.gguf]
        [--num-requests 16] [--block-dot-products fma|bf16|auto]

Without the HTTP server and its client on the same two cores, the wall time moves less from run to run than the
server's; it is the same engine and scheduler (token budget, chunked prefill) as `serval serve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from bench_step_cost import PartTimer, instrument
from run_peers import MIXED, MIXED_CONCURRENCY

from serval import LLMEngine, SamplingParams
from serval.benchmark.workloads import build_requests
from serval.config import BLOCK_DOT_PRODUCT_CHOICES, EngineConfig, SpeculativeConfig
from serval.platform_info import describe_hardware


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true", help="each kernel called from Python")
    parser.add_argument("--parts", action="store_true", help="time each part (with --enforce-eager)")
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded model)")
    parser.add_argument("--num-requests", type=int, default=MIXED.num_requests,
                        help="the workload's first N requests (its seeded prompts and lengths)")
    parser.add_argument("--block-dot-products", default=EngineConfig.block_dot_products,
                        choices=BLOCK_DOT_PRODUCT_CHOICES)
    args = parser.parse_args()
    if args.parts and not args.enforce_eager:
        parser.error("--parts needs --enforce-eager: a layer's one C++ call has no parts to time")
    torch.set_num_threads(args.threads)
    print(f"machine: {describe_hardware()}", flush=True)
    engine = LLMEngine(EngineConfig(model=args.model, speculative=SpeculativeConfig(method=None),
                                    enforce_eager=args.enforce_eager, block_dot_products=args.block_dot_products))
    timer = PartTimer()
    if args.parts:
        instrument(engine, timer)
    engine.add_request("warm-up", "Hello there", SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    timer.totals.clear()
    workload = dataclasses.replace(MIXED, num_requests=args.num_requests)
    pending = list(enumerate(build_requests(workload)))
    prompt_tokens = 0

    def add_next() -> None:
        index, request = pending.pop(0)
        engine.add_request(f"mixed-{index}", request.prompt,
                           SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True))

    for _ in range(min(MIXED_CONCURRENCY, len(pending))):
        add_next()
    start, steps, output_tokens = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        for output in engine.step():
            if output.finished:
                prompt_tokens += len(output.prompt_token_ids)
                output_tokens += len(output.outputs[0].token_ids)
                if pending:
                    add_next()
    wall = time.perf_counter() - start
    print(f"mixed offline, concurrency {MIXED_CONCURRENCY}: {workload.num_requests} requests, {prompt_tokens} prompt "
          f"and {output_tokens} output tokens in {steps} steps, wall {wall:.2f} s", flush=True)
    for part, seconds in sorted(timer.totals.items(), key=lambda item: -item[1]):
        print(f"  {part:14s} {seconds:6.2f} s")


if __name__ == "__main__":
    main()
