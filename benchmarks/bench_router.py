"""`serval router` on the shared-prefix workload: one replica, then two with least-outstanding routing, then two with
cache-aware routing, side by side in one run.

    .venv/bin/python benchmarks/bench_router.py [--prefixes 8] [--questions 6] [--concurrency 4]

Two `serval serve` replicas start once, each with a small KV cache (`--kv-cache-memory`, default 0.05 GiB: 145
blocks) that holds about half of the prefixes; every setup gets its own prefixes (no setup finds another's in a
cache). Each request is a system prompt (one of ``--prefixes``, ~530 tokens) and a short question, sent in a seeded
random order, ``--concurrency`` at a time, streaming, greedy, 32 tokens. Reported per setup: throughput, TTFT and
E2E percentiles, and the prompt tokens the replicas served from their prefix caches (their /metrics).
One replica gets every core; two split them (OMP_NUM_THREADS = cores / 2 each, as `serval router --spawn` does): on
this machine's 2 cores a second replica adds no compute, only cache room.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serval.benchmark.client import Endpoint, LoadConfig, run_load  # noqa: E402
from serval.benchmark.metrics import summarize  # noqa: E402
from serval.benchmark.workloads import BenchRequest, prose  # noqa: E402
from serval.cluster.router import spawn_replicas  # noqa: E402
from serval.platform_info import describe_hardware  # noqa: E402

SETUPS = [("1 replica", 1, "least_outstanding"), ("2 replicas, least outstanding", 2, "least_outstanding"),
          ("2 replicas, cache-aware", 2, "cache_aware")]


def prefix_hits(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("serval:prefix_cache_hits_total "):
                total += float(line.split()[1])
    return total


def workload(setup: str, args, rng: random.Random) -> list[BenchRequest]:
    prefixes = [f"[{setup}, office {p}] You answer questions about this office. " + prose(rng, 380)
                for p in range(args.prefixes)]
    requests = [BenchRequest(f"Question {q}: what should I know about {prose(rng, 6)}?", 32, system)
                for system in prefixes for q in range(args.questions)]
    rng.shuffle(requests)
    return requests


def start_router(urls: list[str], policy: str, port: int, log: Path):
    import subprocess

    cmd = [sys.executable, "-m", "serval.cli", "--log-level", "INFO", "router", "--port", str(port), "--policy",
           policy, *[arg for url in urls for arg in ("--replica", url)]]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"router did not start: {log.read_text()[-2000:]}")
        time.sleep(0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--questions", type=int, default=6, help="questions per prefix")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-memory", type=float, default=0.05, help="GiB per replica")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    print(f"machine: {describe_hardware()}", flush=True)
    results = {"machine": describe_hardware(), "args": vars(args), "setups": {}}
    rng = random.Random(0)
    procs, urls = [], []
    try:
        for i, (name, replicas, policy) in enumerate(SETUPS):
            if len(urls) != replicas:  # a fleet of this size, the cores split among its replicas
                for proc in procs:
                    proc.terminate()
                    proc.wait(60)
                print(f"starting {replicas} replica(s) ...", flush=True)
                procs, urls = spawn_replicas(replicas, ["--kv-cache-memory", str(args.kv_cache_memory)])
            print(f"[{i + 1}/{len(SETUPS)}] {name} ({policy}) ...", flush=True)
            port = 18080 + i
            router = start_router(urls, policy, port, Path(f"/tmp/bench_router_{i}.log"))
            try:
                requests = workload(name, args, rng)
                hits_before = prefix_hits(urls)
                endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "smollm2-135m-instruct", chat=True,
                                    ignore_eos=True)
                done, duration = asyncio.run(run_load(endpoint, requests, LoadConfig(concurrency=args.concurrency),
                                                      progress=False))
                summary = summarize(done, duration)
                hits = prefix_hits(urls) - hits_before
                row = {"requests": summary["completed"], "failed": summary["failed"],
                       "wall_s": round(duration, 1), "request_throughput": round(summary["request_throughput"], 2),
                       "output_tok_s": round(summary["output_throughput"], 1),
                       "ttft_ms": {k: round(v, 1) for k, v in summary["ttft_ms"].items()},
                       "e2e_ms": {k: round(v, 1) for k, v in summary["e2e_ms"].items()},
                       "prompt_tokens": summary["prompt_tokens"],
                       "cached_share": round(hits / summary["prompt_tokens"], 3)}
                results["setups"][name] = row
                print(f"    {row}", flush=True)
            finally:
                router.terminate()
                router.wait(30)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    print(f"\n{'':<34}" + "".join(f"{name:>32}" for name in results["setups"]))
    rows = (("requests/s", lambda r: r["request_throughput"]), ("output tok/s", lambda r: r["output_tok_s"]),
            ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]), ("TTFT p90 (ms)", lambda r: r["ttft_ms"]["p90"]),
            ("E2E p50 (ms)", lambda r: r["e2e_ms"]["p50"]), ("prompt tokens from cache", lambda r: r["cached_share"]))
    for label, get in rows:
        print(f"{label:<34}" + "".join(f"{get(r):>32}" for r in results["setups"].values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
