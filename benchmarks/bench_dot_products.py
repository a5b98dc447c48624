"""The block kernel's two ways to multiply bfloat16 activations with q4, q4k, q6k and q8 blocks
(EngineConfig.block_dot_products): float32 FMAs on the decoded weights ("fma", csrc/panel_linear.cpp) against
bfloat16 dot products on the codes ("bf16", csrc/bf16_dot_linear.cpp). One thread, its CPU time (time.thread_time),
the two alternated in one process, medians of rounds, so that other work on a shared machine moves the ratios little.

    .venv/bin/python benchmarks/bench_dot_products.py [--model F.gguf] [--rows 1,4,16,64,128] [--batch 1,16]
        [--rounds 5]

1. The model's (default: the embedded one's) distinct linears (layer 0's fused q/k/v, o, gate/up, down, the
   head, and any other block formats' in later layers) at each row count: microseconds a call, fma -> bf16.
2. The offline decode step (LLMEngine, greedy, speculation off) at each batch size: milliseconds a step, and
   whether the two kernels' greedy tokens agree (they differ in float32 rounding, so near-ties may part).

With --fma-path N1xK1,N2xK2 (and --threads), only random q4 matrices of those shapes at each row count, wall
microseconds a call: the float32 kernel / the dot products / the dot products by their FMA path from the first row
(where this CPU's vdpbf16ps is two FMAs in turn: bf16_dot_linear.cpp's gemm_by_fmas) / the dot products on AMX
tiles (where the CPU has AMX-BF16: gemm_by_tiles), each where this CPU has it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from serval import LLMEngine, SamplingParams
from serval.config import EngineConfig, SpeculativeConfig
from serval.layers import cpu_kernels
from serval.layers.linear import BlockQuantLinear, random_q4_weight, use_dot_products
from serval.platform_info import describe_hardware

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
CHOICES = ("fma", "bf16")


def bench_linears(model, rows_list: list[int], rounds: int) -> None:
    print(f"{'linear':<32}{'N x K':>12}" + "".join(f"{r:>16}" for r in rows_list) + "   (us a call, fma -> bf16)")
    seen = set()
    for name, module in model.named_modules():
        if not isinstance(module, BlockQuantLinear):
            continue
        shape = (module.formats, module.out_features, module.in_features)
        if shape in seen:
            continue
        seen.add(shape)
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, module.in_features).bfloat16()
            calls = max(1, 4000 // (rows * module.out_features // 256 + 1))
            found = {c: [] for c in CHOICES}
            for _ in range(rounds):
                for choice in CHOICES:
                    module.dot_products = choice
                    module(x)
                    start = time.thread_time()
                    for _ in range(calls):
                        module(x)
                    found[choice].append((time.thread_time() - start) / calls * 1e6)
            a, b = (statistics.median(found[c]) for c in CHOICES)
            cells.append(f"{a:7.0f}->{b:6.0f}")
        print(f"{name:<32}{f'{module.out_features}x{module.in_features}':>12}" + "".join(f"{c:>16}" for c in cells),
              flush=True)


def bench_steps(engine: LLMEngine, batch: int, steps: int, rounds: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    found = {c: [] for c in CHOICES}
    tokens = {c: {} for c in CHOICES}
    for i in range(rounds):
        for choice in CHOICES:
            use_dot_products(engine.core.model, choice)
            for j in range(batch):
                engine.add_request(f"{choice}-{i}-{j}", f"{PROMPT} (story {j})", params)
            engine.step()  # the prefills
            times = []
            while engine.has_unfinished_requests():
                start = time.thread_time()
                for output in engine.step():
                    tokens[choice][output.request_id.split("-", 2)[2]] = output.outputs[0].token_ids
                times.append(time.thread_time() - start)
            found[choice].append(statistics.median(times))
    a, b = (statistics.median(found[c]) * 1e3 for c in CHOICES)
    same = sum(tokens["fma"][k] == tokens["bf16"][k] for k in tokens["fma"])
    print(f"decode step, {batch} rows (median of {rounds} x {steps} steps, ms): fma {a:.2f}, bf16 {b:.2f} "
          f"({a / b:.2f}x); greedy tokens equal in {same} of {len(tokens['fma'])}", flush=True)


def bench_fma_path(shapes: list[tuple[int, int]], rows_list: list[int], rounds: int) -> None:
    kernels = cpu_kernels.load()
    generator = torch.Generator().manual_seed(0)
    # (name, FMA path from rows, kernel): each where this CPU has it
    ways = [("fma", 0, kernels.block_panel_linear)]
    if kernels.block_bf16_dot_kernel_available():
        ways.append(("bf16", 0, kernels.block_panel_linear_bf16_dot))
    if kernels.bf16_dot_is_two_fmas():
        ways.append(("bf16 by FMAs", 1, kernels.block_panel_linear_bf16_dot))
    if kernels.bf16_dot_tiles_available():
        ways.append(("bf16 on AMX tiles", 0, functools.partial(kernels.block_panel_linear_bf16_dot, tiles=True)))
    print("N x K, rows: us a call, " + " / ".join(name for name, _, _ in ways), flush=True)
    try:
        for n, k in shapes:
            panels = random_q4_weight(n, k, generator).panels()
            for rows in rows_list:
                x = torch.randn(rows, k, generator=generator).bfloat16()
                found: dict[str, list[float]] = {name: [] for name, _, _ in ways}
                for _ in range(rounds):
                    for name, fma_rows, linear in ways:
                        kernels.set_bf16_dot_fma_rows(fma_rows)
                        calls = max(2, 64 // rows)
                        start = time.perf_counter()
                        for _ in range(calls):
                            linear(x, *panels, "q4", n, False)
                        found[name].append((time.perf_counter() - start) / calls * 1e6)
                print(f"{n} x {k}, {rows} rows: " + " / ".join(f"{statistics.median(v):.0f}" for v in found.values()),
                      flush=True)
    finally:
        kernels.set_bf16_dot_fma_rows(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded model)")
    parser.add_argument("--rows", default="1,4,16,64,128")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fma-path", default=None, metavar="NxK,...",
                        help="only random q4 matrices of these shapes, by each kernel path this CPU has")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.fma_path:
        torch.set_num_threads(args.threads)
        print(f"machine: {describe_hardware()}", flush=True)
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.fma_path.split(",")]
        bench_fma_path(shapes, [int(r) for r in args.rows.split(",")], args.rounds)
        return
    torch.set_num_threads(1)
    print(f"machine: {describe_hardware()}; 1 thread", flush=True)
    model = {} if args.model is None else {"model": args.model}
    engine = LLMEngine(EngineConfig(**model, dtype="bfloat16", speculative=SpeculativeConfig(method=None)))
    print(f"--block-dot-products auto chose {engine.core.dot_products} here", flush=True)
    if not cpu_kernels.load() or not cpu_kernels.load().block_bf16_dot_kernel_available():
        raise SystemExit("no bfloat16 dot-product kernel on this CPU (it needs AVX-512 BF16)")
    bench_linears(engine.core.model, [int(r) for r in args.rows.split(",")], args.rounds)
    for batch in (int(b) for b in args.batch.split(",")):
        bench_steps(engine, batch, args.steps, args.rounds)


if __name__ == "__main__":
    main()
