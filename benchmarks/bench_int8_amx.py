"""The int8-activation kernel on AMX tiles against its vector (VNNI) twin (csrc/int8_linear.cpp; the same bits), on a
CPU with AMX-INT8: the two alternated in one process, medians.

    .venv/bin/python benchmarks/bench_int8_amx.py [--rows 16,32,64,256,512] [--threads 1,2] [--prompt-tokens 1000]

1. The embedded model's distinct Q4_1 linears (layer 0's fused q/k/v, o, gate/up, down) at each row count, bfloat16
   activations: microseconds a call (1 thread: CPU time of this thread; more: wall time).
2. The prefill of one prompt of about --prompt-tokens tokens through LLMEngine with activation_quantization "int8"
   (the engine's own chunking, max_tokens 1, 1 and 2 threads): wall and process CPU seconds, the kernel choice forced
   per run (CPU time moves less when other work shares the machine).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from serval import LLMEngine, SamplingParams
from serval.config import CacheConfig, EngineConfig, SpeculativeConfig
from serval.layers import cpu_kernels
from serval.layers.linear import BlockQuantLinear
from serval.platform_info import describe_hardware

KERNELS = ("vector", "amx")


def median_seconds(fn, repeats: int, clock) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def bench_linears(model, rows_list: list[int], threads: int, rounds: int) -> None:
    kernels = cpu_kernels.load()
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, BlockQuantLinear) and module.formats == ("q4",):
            seen.setdefault((module.out_features, module.in_features), name)
    print(f"\n{threads} thread(s): microseconds a call, vector -> amx")
    for (n, k), name in seen.items():
        (part,) = model.get_submodule(name).block_weights()
        panels = part.panels()
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, k).to(torch.bfloat16)
            repeats = max(3, min(100, int(3e8 / (n * k * rows))))
            found = {kernel: [] for kernel in KERNELS}
            for _ in range(rounds):
                for kernel in KERNELS:
                    call = functools.partial(kernels.block_panel_linear_int8, x, *panels, "q4", n, False, kernel=kernel)
                    call()
                    found[kernel].append(median_seconds(call, repeats, clock))
            a, b = (statistics.median(found[kernel]) * 1e6 for kernel in KERNELS)
            cells.append(f"{rows}: {a:.0f} -> {b:.0f} ({a / b:.2f}x)")
        print(f"{name:<32}{f'{n}x{k}':>10}  " + " | ".join(cells), flush=True)


def force_kernel(model, kernel: str) -> None:
    linear = functools.partial(cpu_kernels.load().block_panel_linear_int8, kernel=kernel)
    for module in model.modules():
        if isinstance(module, BlockQuantLinear) and module._panel_linear_int8 is not None:
            module._panel_linear_int8 = linear


def bench_prefill(engine: LLMEngine, prompt_tokens: int, rounds: int, threads: int) -> None:
    torch.set_num_threads(threads)
    words = "The quick brown fox jumps over the lazy dog while the old fisherman mends his nets by the sea. "
    prompt = words * (prompt_tokens // 20)
    params = SamplingParams(temperature=0, max_tokens=1)
    found = {kernel: [] for kernel in KERNELS}
    cpu = {kernel: [] for kernel in KERNELS}
    first_tokens = {}
    for i in range(rounds):
        for kernel in KERNELS:  # prefix caching is off: every run computes the whole prompt
            force_kernel(engine.model, kernel)
            engine.add_request(f"{kernel}-{i}", prompt, params)
            start, cpu_start = time.perf_counter(), time.process_time()
            while engine.has_unfinished_requests():
                for output in engine.step():
                    first_tokens[kernel] = output.outputs[0].token_ids
            found[kernel].append(time.perf_counter() - start)
            cpu[kernel].append(time.process_time() - cpu_start)
    prompt_len = len(engine.tokenizer.encode(prompt))
    print(f"\nprompt tokens: {prompt_len}; first token the same: {first_tokens['vector'] == first_tokens['amx']}")
    a, b = (statistics.median(found[kernel]) for kernel in KERNELS)
    c, d = (statistics.median(cpu[kernel]) for kernel in KERNELS)
    print(f"prefill of one ~{prompt_tokens}-token prompt (median of {rounds}, {threads} thread(s)): wall s vector "
          f"{a:.3f}, amx {b:.3f} ({a / b:.2f}x); process CPU s vector {c:.3f}, amx {d:.3f} ({c / d:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64,256,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--prefill-threads", default="1,2")
    parser.add_argument("--no-linears", action="store_true")
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.block_int8_amx_available():
        raise SystemExit("needs the C++ kernels on a CPU with AMX-INT8")
    print(f"machine: {describe_hardware()}")
    config = EngineConfig(dtype="bfloat16", device="cpu", quantization="gguf", activation_quantization="int8",
                          speculative=SpeculativeConfig(method=None), cache=CacheConfig(enable_prefix_caching=False))
    engine = LLMEngine(config)
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",") if not args.no_linears):
            bench_linears(engine.model, [int(r) for r in args.rows.split(",")], threads, args.rounds)
    for threads in (int(t) for t in args.prefill_threads.split(",")):
        bench_prefill(engine, args.prompt_tokens, args.rounds, threads)


if __name__ == "__main__":
    main()
