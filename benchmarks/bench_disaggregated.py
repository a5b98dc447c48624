"""Disaggregated prefill/decode against one worker and against two whole workers, on the mixed workload, one run.

    .venv/bin/python benchmarks/bench_disaggregated.py [--num-requests 32] [--concurrency 16]

Three setups, each alone on the machine in turn, the same seeded requests (20-600 words in, 16-128 tokens out,
``ignore_eos``, streaming completions):
- one worker: `serval serve` with every core;
- two whole workers behind `serval router` (least outstanding), the cores split between them;
- a prefill worker and a decode worker (`serve --role prefill|decode`) behind `serval router --prefill --decode`,
  the cores split between them.
Reported: throughput, TTFT, TPOT and ITL percentiles, and for the disaggregated setup the KV moved (blocks and bytes
per request, the share sent while the prompt's later chunks still computed, the decode worker's fetch time per
request: asked, at the same time as the prefill, to last block) from the workers' /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serval.benchmark.client import Endpoint, LoadConfig, run_load  # noqa: E402
from serval.benchmark.metrics import summarize  # noqa: E402
from serval.benchmark.workloads import WorkloadConfig, build_requests  # noqa: E402
from serval.platform_info import describe_hardware  # noqa: E402

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """A `serval` process on a free port (serve or router), once it answers /health."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    verb, rest = args[0], args[1:]
    proc = subprocess.Popen([sys.executable, "-m", "serval.cli", "--log-level", "WARNING", verb, "--port", str(port),
                             *rest], stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{' '.join(args)} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)


def counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("serval:kv_transfer_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def setups(cores: int) -> dict[str, list[tuple[list[str], int]]]:
    half = max(1, cores // 2)
    return {
        "one worker": [(["serve"], cores)],
        "two workers": [(["serve"], half), (["serve"], half), (["router", "--policy", "least_outstanding"], 1)],
        "prefill + decode": [(["serve", "--role", "prefill"], half), (["serve", "--role", "decode"], half),
                             (["router"], 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--setups", default=None, help="comma-separated subset of the setups' names")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    machine = describe_hardware()
    print(f"machine: {machine}", flush=True)
    cores = os.cpu_count() or 1
    requests = build_requests(WorkloadConfig("random", args.num_requests, (20, 600), (16, 128), seed=3))
    results = {"machine": machine, "args": vars(args), "setups": {}}
    chosen = setups(cores)
    if args.setups:
        chosen = {k: v for k, v in chosen.items() if k in args.setups.split(",")}
    for i, (name, processes) in enumerate(chosen.items()):
        print(f"[{i + 1}/{len(chosen)}] {name}: starting ...", flush=True)
        procs, urls = [], []
        try:
            for j, (command, threads) in enumerate(processes):
                if command[0] == "router":
                    workers = urls[:]
                    flags = [("--prefill", workers[0]), ("--decode", workers[1])] if name == "prefill + decode" \
                        else [("--replica", u) for u in workers]
                    command = command + [a for pair in flags for a in pair]
                proc, url = start(command, Path(f"/tmp/bench_disagg_{i}_{j}.log"), threads)
                procs.append(proc)
                urls.append(url)
            before = {u: counters(u) for u in urls[:2]}
            endpoint = Endpoint(f"{urls[-1]}/v1", MODEL, ignore_eos=True)
            done, duration = asyncio.run(run_load(endpoint, requests, LoadConfig(concurrency=args.concurrency),
                                                  progress=True))
            summary = summarize(done, duration)
            row = {"completed": summary["completed"], "failed": summary["failed"], "wall_s": round(duration, 1),
                   "output_tok_s": round(summary["output_throughput"], 1),
                   **{f"{m}_ms": {k: round(v, 1) for k, v in summary[f"{m}_ms"].items()}
                      for m in ("ttft", "tpot", "itl")}}
            if name == "prefill + decode":
                sent = {k: v - before[urls[0]].get(k, 0) for k, v in counters(urls[0]).items()}
                got = {k: v - before[urls[1]].get(k, 0) for k, v in counters(urls[1]).items()}
                fetches = max(1.0, got.get("serval:kv_transfer_fetches_total", 0))
                row["kv_transfer"] = {
                    "fetches": int(got.get("serval:kv_transfer_fetches_total", 0)),
                    "failed_fetches": int(got.get("serval:kv_transfer_failed_fetches_total", 0)),
                    "blocks_per_request": round(sent.get("serval:kv_transfer_sent_blocks_total", 0) / fetches, 1),
                    "kib_per_request": round(sent.get("serval:kv_transfer_sent_bytes_total", 0) / fetches / 1024, 1),
                    # blocks that went while their prompt's later chunks still computed: the overlapped transfer
                    "sent_early_share": round(sent.get("serval:kv_transfer_sent_early_blocks_total", 0)
                                              / max(1.0, sent.get("serval:kv_transfer_sent_blocks_total", 0)), 3),
                    "fetch_ms_per_request": round(1000 * got.get("serval:kv_transfer_fetch_seconds_total", 0)
                                                  / fetches, 2)}
            results["setups"][name] = row
            print(f"    {row}", flush=True)
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                proc.wait(60)
    names = list(results["setups"])
    print(f"\nmachine: {machine}\n{'':<22}" + "".join(f"{n:>20}" for n in names))
    rows = (("wall s", lambda r: r["wall_s"]), ("output tok/s", lambda r: r["output_tok_s"]),
            ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]), ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
            ("TPOT p50 ms", lambda r: r["tpot_ms"]["p50"]), ("ITL p50 ms", lambda r: r["itl_ms"]["p50"]),
            ("ITL p99 ms", lambda r: r["itl_ms"]["p99"]), ("failed", lambda r: r["failed"]))
    for label, get in rows:
        print(f"{label:<22}" + "".join(f"{get(r):>20}" for r in results["setups"].values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
