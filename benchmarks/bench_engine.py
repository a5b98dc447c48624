"""Offline engine benchmark on the embedded model: load time, single-stream decode, 16-request throughput,
TTFT / TPOT percentiles, and Hugging Face transformers on the same weights in the same run for a ratio.

    .venv/bin/python benchmarks/bench_engine.py [--dtype bfloat16] [--tokens 128] [--no-hf]

Wall-clock numbers vary between sessions on shared machines: compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from serval import LLMEngine, SamplingParams
from serval.config import EngineConfig
from serval.platform_info import describe_hardware

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_engine(engine: LLMEngine, num_requests: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    arrival, first, last, gaps, count = {}, {}, {}, [], {}
    for i in range(num_requests):
        rid = f"b{i}-{time.monotonic_ns()}"
        engine.add_request(rid, PROMPT + f" number {i}", params)
        arrival[rid] = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids)
            if rid not in first:
                first[rid] = now
            elif n > count.get(rid, 0):
                gaps.append(now - last[rid])
            last[rid], count[rid] = now, n
    elapsed = time.perf_counter() - start
    generated = sum(count.values())
    ttft = [first[r] - arrival[r] for r in arrival]
    tpot = [(last[r] - first[r]) / max(1, count[r] - 1) for r in arrival]
    return {
        "requests": num_requests, "generated_tokens": generated, "seconds": round(elapsed, 3),
        "tokens_per_s": round(generated / elapsed, 1),
        "ttft_ms": {p: round(1000 * percentile(ttft, p), 1) for p in (50, 90, 99)},
        "tpot_ms": {p: round(1000 * percentile(tpot, p), 1) for p in (50, 90, 99)},
        "itl_ms": {p: round(1000 * percentile(gaps, p), 1) for p in (50, 90, 99)} if gaps else {},
    }


def run_hf(path, dtype: torch.dtype, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    generated = out.shape[1] - ids.shape[1]
    return {"requests": 1, "generated_tokens": generated, "seconds": round(elapsed, 3),
            "tokens_per_s": round(generated / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    print(f"machine: {describe_hardware()}", flush=True)
    print(f"[1/4] loading the engine ({args.dtype}, {args.device}, weights {args.quantization}) ...", flush=True)
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, device=args.device, quantization=args.quantization))
    results = {"machine": describe_hardware(), "dtype": engine.config.dtype, "quantization": args.quantization,
               "load_s": round(time.perf_counter() - start, 2)}
    run_engine(engine, 1, 8)  # warm-up
    print("[2/4] single stream ...", flush=True)
    results["serval_single"] = run_engine(engine, 1, args.tokens)
    print(f"[3/4] {args.batch} concurrent requests ...", flush=True)
    results[f"serval_batch{args.batch}"] = run_engine(engine, args.batch, args.tokens)
    if not args.no_hf:
        print("[4/4] transformers baseline (single stream) ...", flush=True)
        results["transformers_single"] = run_hf(engine.model_path, engine.config.torch_dtype, args.tokens)
        results["single_stream_ratio_vs_transformers"] = round(
            results["serval_single"]["tokens_per_s"] / results["transformers_single"]["tokens_per_s"], 2)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"median single-stream TPOT {statistics.median([results['serval_single']['tpot_ms'][50]]):.1f} ms")


if __name__ == "__main__":
    main()
