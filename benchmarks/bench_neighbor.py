"""Serval beside a busy neighbor (issue 51, part 5): the same workloads alone and with N processes spinning on the
cores (`python3 -c "while True: pass"`), in one ratio table. The target: with one neighbor on 2 cores, one stream
and decode-heavy keep >= 0.4x their figures alone.

One `serval serve` (the embedded model unless --model) is started once; every round measures each workload alone,
then starts the neighbors, measures again and stops them. Serval's start-up line "threads: ..." (the threads it
chose, and why, and how its threads wait) is shown beside the table.

    .venv/bin/python benchmarks/bench_neighbor.py                                  # 1 neighbor, 2 rounds
    .venv/bin/python benchmarks/bench_neighbor.py --neighbors 1 --neighbor-cpus 1  # the neighbor pinned to CPU 1
    .venv/bin/python benchmarks/bench_neighbor.py --env OMP_WAIT_POLICY=active     # A/B against the old waits
    .venv/bin/python benchmarks/bench_neighbor.py --rounds 1 --output-tokens 16 --num-requests 2   # a smoke run

Only ratios from one run mean anything: a shared machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: this repository's serval, installed or not

from run_peers import MODEL_NAME, Server, free_port, start, stop  # noqa: E402

from serval.benchmark.client import Endpoint, LoadConfig  # noqa: E402
from serval.benchmark.serve import ServeBenchConfig, run_serve_benchmark  # noqa: E402
from serval.benchmark.workloads import WorkloadConfig  # noqa: E402
from serval.platform_info import cpu_capability, cpu_model  # noqa: E402

NEIGHBOR = "while True: pass"


def workloads(args: argparse.Namespace) -> list[tuple[str, WorkloadConfig, int]]:
    """(name, workload, concurrency): one stream, and decode-heavy (many streams, short prompts, long outputs)."""
    tokens = (args.output_tokens, args.output_tokens)
    return [("single", WorkloadConfig("random", args.single_requests, (10, 40), tokens, seed=1), 1),
            ("decode-heavy", WorkloadConfig("random", args.num_requests, (10, 40), tokens, seed=2),
             args.concurrency)]


def start_neighbors(count: int, cpus: str | None) -> list[subprocess.Popen]:
    prefix = ["taskset", "-c", cpus] if cpus else []
    return [subprocess.Popen(prefix + [sys.executable, "-c", NEIGHBOR]) for _ in range(count)]


def stop_neighbors(neighbors: list[subprocess.Popen]) -> None:
    for proc in neighbors:
        proc.kill()
    for proc in neighbors:
        proc.wait()


def measure(port: int, name: str, workload: WorkloadConfig, concurrency: int) -> float:
    """Output tokens per second of one workload (ignore_eos: every request runs to its max_tokens)."""
    config = ServeBenchConfig(endpoint=Endpoint(base_url=f"http://127.0.0.1:{port}/v1", model=MODEL_NAME,
                                                ignore_eos=True),
                              workload=workload, load=LoadConfig(concurrency=concurrency, seed=workload.seed),
                              warmup_requests=1)
    summary = run_serve_benchmark(config, progress=False)["summary"]
    for error in summary["errors"]:
        print(f"   {name}: error: {error}", flush=True)
    return summary["output_throughput"]


def threads_line(log_path: Path) -> str:
    match = re.search(r"threads: .*", log_path.read_text(errors="replace"))
    return match.group(0) if match else "(no threads line in the server's log)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--neighbors", type=int, default=1, help="busy processes started beside the server")
    parser.add_argument("--neighbor-cpus", help="taskset -c list the neighbors are pinned to (default: unpinned)")
    parser.add_argument("--server-cpus", help="taskset -c list the server is pinned to (default: unpinned)")
    parser.add_argument("--rounds", type=int, default=2, help="alone-then-neighbor pairs, back to back")
    parser.add_argument("--single-requests", type=int, default=2, help="requests of the one-stream workload")
    parser.add_argument("--num-requests", type=int, default=16, help="requests of the decode-heavy workload")
    parser.add_argument("--concurrency", type=int, default=8, help="decode-heavy's requests in flight")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--model", help="the model to serve (default: the embedded one)")
    parser.add_argument("--serval-flags", default="", help="more `serval serve` flags")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in the server's environment (e.g. OMP_WAIT_POLICY=active, OMP_NUM_THREADS=1)")
    parser.add_argument("--log-dir", default="benchmarks/latest", help="where the server's log goes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the server may take to start")
    args = parser.parse_args()

    command = ([] if not args.server_cpus else ["taskset", "-c", args.server_cpus]) + [
        sys.executable, "-m", "serval.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
        "--served-model-name", MODEL_NAME, "--disable-log-requests"] + shlex.split(args.serval_flags)
    if args.model:
        command += ["--model", args.model]
    env = {"PYTHONPATH": str(ROOT), **dict(item.split("=", 1) for item in args.env)}
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "bench_neighbor_server.log"
    port = free_port()
    print(f"machine: {cpu_model()}, capability {cpu_capability()}, {os.cpu_count()} CPUs, affinity "
          f"{len(os.sched_getaffinity(0))}; neighbors: {args.neighbors}"
          f"{' on CPUs ' + args.neighbor_cpus if args.neighbor_cpus else ' (unpinned)'}", flush=True)
    if args.env:
        print(f"server environment: {' '.join(args.env)}", flush=True)
    proc = start(Server("serval", command, is_serval=True, env=env), port, log_path, args.timeout)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        print(threads_line(log_path), flush=True)
        for round_index in range(args.rounds):
            for with_neighbors in (False, True):
                neighbors = start_neighbors(args.neighbors, args.neighbor_cpus) if with_neighbors else []
                try:
                    time.sleep(0.5 if neighbors else 0)  # the neighbors running before the first request
                    for name, workload, concurrency in workloads(args):
                        tok_s = measure(port, name, workload, concurrency)
                        key = "neighbor" if with_neighbors else "alone"
                        results.setdefault(name, {"alone": [], "neighbor": []})[key].append(tok_s)
                        print(f"   round {round_index + 1} {name} {key}: {tok_s:.1f} tok/s", flush=True)
                finally:
                    stop_neighbors(neighbors)
    finally:
        stop(proc)
    print(f"\n{'workload':<14}{'alone tok/s':>20}{'neighbor tok/s':>20}{'ratio':>8}")
    for name, runs in results.items():
        alone, busy = statistics.median(runs["alone"]), statistics.median(runs["neighbor"])

        def spread(values: list[float]) -> str:
            return f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})"

        print(f"{name:<14}{spread(runs['alone']):>20}{spread(runs['neighbor']):>20}{busy / alone:>8.2f}")
    print("(medians over rounds, min-max in brackets; ratio = neighbor / alone)")


if __name__ == "__main__":
    main()
