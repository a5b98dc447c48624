"""Model parallelism's step time: one process against tensor and pipeline parallelism over 2 processes, one run.

    .venv/bin/python benchmarks/bench_parallel.py [--tokens 64] [--setups tp1,tp2,pp2,tp2pp2]

Each setup is an offline engine (`LLMEngine`, the default dtype, speculation off so every step is one token a
request) on the embedded model, measured at 1 and 16 streams (greedy, ``ignore_eos``, ``--tokens`` each): tokens/s
and the decode step's time (TPOT). The ranks share the machine's cores (OMP threads = cores / ranks each): on one
small CPU, splitting a model adds collectives and takes nothing off a memory-bound step; the point of model
parallelism is models and caches larger than one device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import run_engine  # noqa: E402

from serval import LLMEngine  # noqa: E402
from serval.config import EngineConfig, SpeculativeConfig  # noqa: E402
from serval.platform_info import describe_hardware  # noqa: E402

SETUPS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
          "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    machine = describe_hardware()
    print(f"machine: {machine}", flush=True)
    results = {"machine": machine, "args": vars(args), "setups": {}}
    for name in args.setups.split(","):
        print(f"{name}: loading ...", flush=True)
        engine = LLMEngine(EngineConfig(speculative=SpeculativeConfig(method=None), **SETUPS[name]))
        try:
            run_engine(engine, 1, 4)  # warm-up
            row = {streams: run_engine(engine, streams, args.tokens) for streams in (1, 16)}
        finally:
            engine.shutdown()
        results["setups"][name] = row
        print(f"    1 stream {row[1]['tokens_per_s']} tok/s (TPOT p50 {row[1]['tpot_ms'][50]} ms), 16 streams "
              f"{row[16]['tokens_per_s']} tok/s (TPOT p50 {row[16]['tpot_ms'][50]} ms)", flush=True)
    print(f"\nmachine: {machine}\n{'':<26}" + "".join(f"{n:>12}" for n in results["setups"]))
    for label, streams, key in (("1 stream tok/s", 1, "tokens_per_s"), ("16 streams tok/s", 16, "tokens_per_s")):
        print(f"{label:<26}" + "".join(f"{r[streams][key]:>12}" for r in results["setups"].values()))
    for label, streams in (("1 stream step (TPOT p50)", 1), ("16 streams step (TPOT p50)", 16)):
        print(f"{label:<26}" + "".join(f"{r[streams]['tpot_ms'][50]:>10}ms" for r in results["setups"].values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
