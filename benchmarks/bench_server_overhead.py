"""One stream through the server against the offline engine, interleaved: what the HTTP front end costs a token.

    .venv/bin/python benchmarks/bench_server_overhead.py [--rounds 8] [--output-tokens 256] [-- SERVE FLAGS]

Starts `serval serve` (speculation off unless the serve flags say otherwise) and loads an offline `LLMEngine` with
the same settings in this process, then alternates one greedy request of exactly --output-tokens tokens on each,
round after round, so that both see the same machine: on a shared machine the speed of one command drifts by more
than the difference measured here. TPOT is (last token - first token) / (tokens - 1) on both sides; the server's is
timed by the benchmark client (serval/benchmark/client.py) as `serval bench serve` times it. Also reports the CPU
time the server's front-end process and this client spent per token (on two cores they share the cores with the
engine core's threads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run_peers import Server, free_port, start, stop  # this folder's: started and waited for as the peers are

from serval.benchmark.client import Endpoint, send_one
from serval.benchmark.workloads import BenchRequest
from serval.cli import _engine_config, build_parser
from serval.engine.engine import LLMEngine
from serval.platform_info import describe_hardware
from serval.sampling_params import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a strange map washed up on the shore one winter night."
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def offline_tpot_ms(engine: LLMEngine, max_tokens: int, tag: str) -> float:
    engine.add_request(tag, PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        if engine.step():
            times.append(time.perf_counter())
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


def server_tpot_ms(endpoint: Endpoint, max_tokens: int) -> float:
    async def one():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            return await send_one(session, endpoint, BenchRequest(PROMPT, max_tokens), time.perf_counter())

    result = asyncio.run(one())
    if not result.ok:
        raise RuntimeError(f"the server failed the request: {result.error}")
    return 1000 * (result.e2e - result.ttft) / (result.output_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for serval serve (and the offline engine)")
    args = parser.parse_args()
    serve_flags = args.serve_flags or ["--speculative-model", "none"]
    print(f"machine: {describe_hardware()}", flush=True)
    port = free_port()
    command = [sys.executable, "-m", "serval.cli", "serve", "--port", str(port), *serve_flags]
    print("starting serval serve", *serve_flags, flush=True)
    server = start(Server("serval", command), port, Path(tempfile.mkdtemp()) / "serve.log", timeout_s=600)
    try:
        # The offline engine from the same flags, as `serval serve` builds its own.
        engine = LLMEngine(_engine_config(build_parser().parse_args(["serve", *serve_flags])))
        endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "smollm2-135m-instruct", ignore_eos=True)
        offline_tpot_ms(engine, 16, "warm-up")
        server_tpot_ms(endpoint, 16)
        offline, served, client_cpu, front_cpu = [], [], 0.0, 0.0
        for round_ in range(args.rounds):
            offline.append(offline_tpot_ms(engine, args.output_tokens, f"r{round_}"))
            front, mine = process_cpu_s(server.pid), time.thread_time()
            served.append(server_tpot_ms(endpoint, args.output_tokens))
            front_cpu += process_cpu_s(server.pid) - front
            client_cpu += time.thread_time() - mine  # the client is this thread
            print(f"round {round_ + 1}/{args.rounds}: TPOT offline {offline[-1]:.2f} ms, through the server "
                  f"{served[-1]:.2f} ms ({served[-1] / offline[-1] - 1:+.1%})", flush=True)
        tokens = args.rounds * args.output_tokens
        ratios = [s / o for s, o in zip(served, offline)]
        print(f"TPOT p50: offline {statistics.median(offline):.2f} ms, through the server "
              f"{statistics.median(served):.2f} ms; server/offline per round: median {statistics.median(ratios):.3f}"
              f", min {min(ratios):.3f}, max {max(ratios):.3f}")
        print(f"CPU per token: the server's front-end process {1000 * front_cpu / tokens:.3f} ms, this client "
              f"{1000 * client_cpu / tokens:.3f} ms")
        engine.shutdown()
    finally:
        stop(server)


if __name__ == "__main__":
    main()
