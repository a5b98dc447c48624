"""The block kernel with float32 activations against int8 activations (EngineConfig.activation_quantization), on one
thread so that other work on a shared machine moves the figures less: CPU time of this thread (time.thread_time),
medians of many calls, the two kernels alternated in one process.

    .venv/bin/python benchmarks/bench_int8_activations.py [--model smollm2] [--rows 1,4,16,64] [--steps 48]

1. Each distinct linear of the model (the file's own blocks: layer 0's fused q/k/v, o, gate/up, down, and the head)
   at each row count: microseconds a call.
2. The offline one-row decode step (LLMEngine, greedy, no speculation): milliseconds a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from serval import LLMEngine, SamplingParams
from serval.config import EngineConfig, SpeculativeConfig
from serval.layers import cpu_kernels
from serval.layers.linear import BlockQuantLinear, use_activation_quantization
from serval.platform_info import describe_hardware

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
SETTINGS = ("none", "int8")


def thread_seconds(fn, repeats: int) -> float:
    """The median CPU time of this thread over ``repeats`` calls of fn."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def bench_linears(model, rows_list: list[int], dtype: torch.dtype, rounds: int) -> None:
    kernels = cpu_kernels.load()
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, BlockQuantLinear) and (module.out_features, module.in_features) not in seen:
            seen[(module.out_features, module.in_features)] = (name, module)
    print(f"{'linear':<40}{'N x K':>12}{'formats':>12}" + "".join(f"{r:>16}" for r in rows_list))
    for (n, k), (name, layer) in seen.items():
        parts = layer.block_weights()
        panels = [part.panels() for part in parts]
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)
            calls = {"none": kernels.block_panel_linear, "int8": kernels.block_panel_linear_int8}
            repeats = max(5, min(200, int(2e6 / (n * k * rows) * 20)))
            found = {s: [] for s in SETTINGS}
            for _ in range(rounds):  # alternated: a slow spell of the machine hits both
                for setting in SETTINGS:
                    def call(linear=calls[setting], x=x, parts=parts, panels=panels, out=layer.float_output):
                        for part, p in zip(parts, panels):
                            linear(x, *p, part.format, part.out_features, out)
                    call()
                    found[setting].append(thread_seconds(call, repeats))
            a, b = (statistics.median(found[s]) * 1e6 for s in SETTINGS)
            cells.append(f"{a:7.1f}->{b:7.1f}")
        formats = "+".join(part.format for part in parts)
        print(f"{name:<40}{f'{n}x{k}':>12}{formats:>12}" + "".join(f"{c:>16}" for c in cells), flush=True)


def bench_decode(engine: LLMEngine, steps: int, rounds: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    found = {s: [] for s in SETTINGS}
    texts = {}
    for i in range(rounds):
        for setting in SETTINGS:
            use_activation_quantization(engine.model, setting)
            engine.add_request(f"{setting}-{i}", PROMPT, params)
            engine.step()  # the prefill
            times, ids = [], []
            while engine.has_unfinished_requests():
                start = time.thread_time()
                outputs = engine.step()
                times.append(time.thread_time() - start)
                ids = outputs[-1].outputs[0].token_ids if outputs else ids
            found[setting].append(statistics.median(times))
            texts[setting] = list(ids)
    a, b = (statistics.median(found[s]) * 1e3 for s in SETTINGS)
    print(f"one-row decode step (median of {rounds} x {steps} steps, CPU ms of this thread): none {a:.2f}, int8 "
          f"{b:.2f} ({a / b:.2f}x); greedy tokens identical: {texts['none'] == texts['int8']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--no-decode", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe_hardware()}; 1 thread")
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", quantization="gguf",
                          speculative=SpeculativeConfig(method=None))
    engine = LLMEngine(config)
    with torch.inference_mode():
        bench_linears(engine.model, [int(r) for r in args.rows.split(",")], config.torch_dtype, args.rounds)
    if not args.no_decode:
        bench_decode(engine, args.steps, args.rounds)


if __name__ == "__main__":
    main()
