"""How fast the block kernels read a model's weights from memory, beside a plain read of memory: the bandwidth side
of the one-stream roofline (run_peers.py), each round's three reads in the same minute of a shared machine.

    .venv/bin/python benchmarks/bench_stream.py --model ../models/Llama-3.2-1B/Llama-3.2-1B-Q4_K_M.gguf \
        [--threads 2] [--rounds 8] [--setting int8]

A round reads, in turn:
- "sum": run_peers.py's measure of the memory's rate (a torch float32 sum over 1 GiB, best of 5);
- "head": the largest block linear (the head, or the tied embedding) alone, one row, best of 3 calls;
- "layers": every other block linear, one row each, in the model's order, back to back with nothing between them
  (no attention, norms or Python of the engine), once.
Each is GB/s of the weights' bytes (codes and scales); "head/sum" and "layers/sum" are the round's own ratios. A
decode step at one row reads these same bytes, so these ratios bound its share of the roofline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_kernel_ab import multiply, parts
from run_peers import measure_bandwidth

from serval import LLMEngine
from serval.config import EngineConfig, SpeculativeConfig
from serval.layers import cpu_kernels
from serval.layers.linear import BlockQuantLinear
from serval.platform_info import describe_hardware


def block_calls(model, kernels, setting: str) -> list[tuple]:
    """Every block linear part of the model as (call, weight bytes), in the model's order."""
    calls = []
    for module in model.modules():
        if isinstance(module, BlockQuantLinear) and module.kernel is not None:
            x = torch.randn(1, module.in_features)
            for panels, scales, fmt, out_features in parts(module):
                kernel = multiply(kernels, setting, fmt)
                call = (lambda kernel=kernel, x=x, p=panels, s=scales, f=fmt, n=out_features, o=module.float_output:
                        kernel(x, p, s, f, n, o))
                calls.append((call, panels.numel() * panels.element_size() + scales.numel() * scales.element_size()))
    return calls


def read_rate(calls: list[tuple], repeats: int) -> float:
    """GB/s of the calls' weight bytes, the best of ``repeats`` passes over all of them."""
    nbytes = sum(b for _, b in calls)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call, _ in calls:
            call()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or an embedded model's name")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--setting", default="int8", help="how the kernels multiply: int8, bf16 or fma")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device="cpu", quantization="gguf",
                          speculative=SpeculativeConfig(method=None))
    engine = LLMEngine(config)
    torch.set_num_threads(args.threads)  # after the engine, which sets its own count
    print(f"machine: {describe_hardware()}; kernels: {args.setting}")
    with torch.inference_mode():
        calls = block_calls(engine.model, cpu_kernels.load(), args.setting)
        head = max(calls, key=lambda c: c[1])
        layers = [c for c in calls if c is not head]
        print(f"head: {head[1] / 1e6:.1f} MB; layers: {len(layers)} calls, {sum(b for _, b in layers) / 1e6:.1f} MB")
        read_rate(calls, 1)  # threads started, weights touched
        rows = []
        for round_index in range(args.rounds):
            total = measure_bandwidth(args.threads)["bytes_per_s"] / 1e9
            row = {"sum": total, "head": read_rate([head], 3), "layers": read_rate(layers, 1)}
            rows.append(row)
            print(f"round {round_index + 1}: sum {row['sum']:5.1f}  head {row['head']:5.1f}  layers "
                  f"{row['layers']:5.1f} GB/s   head/sum {row['head'] / row['sum']:.2f}  layers/sum "
                  f"{row['layers'] / row['sum']:.2f}", flush=True)
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    ratio = lambda key: statistics.median(r[key] / r["sum"] for r in rows)  # noqa: E731
    print(f"median: sum {median('sum'):.1f}, head {median('head'):.1f}, layers {median('layers'):.1f} GB/s; "
          f"head/sum {ratio('head'):.2f}, layers/sum {ratio('layers'):.2f}")


if __name__ == "__main__":
    main()
