"""The block kernels of this checkout against those of another git revision, in one process on one thread: CPU time
of this thread (time.thread_time), the two builds alternated so that a slow spell of a shared machine hits both.

    .venv/bin/python benchmarks/bench_kernel_ab.py --base main [--model F.gguf] [--rows 1,2,4,16] [--rounds 5]
        [--settings bf16,fma,int8] [--no-decode]

The base revision's csrc/ is built (or loaded from the build cache) under its own name beside this checkout's.
1. Each distinct linear shape of the model (SmolLM2 by default: fused q/k/v, o, gate/up, down, the tied Q8_0 head),
   microseconds a call, for each way the kernels multiply (BlockQuantLinear's settings): "bf16" (bfloat16 dot
   products for q4, q4k, q6k and q8 parts where compiled, the default on such a CPU; float32 FMAs for the others),
   "fma" and "int8". A call goes through every layer's matrix of that shape in turn, as a decode step does, so the
   weights come from beyond the L2 cache as they do there (a loop over one matrix would time it hot in cache).
2. The offline decode step (LLMEngine, greedy, speculation off) at 1 row, each BlockQuantLinear's kernel rebuilt
   from one build or the other, with the layers on the Python path (a C++ layer holds one build's kernels):
   milliseconds a step; and whether the greedy tokens of both builds are the same.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from serval import LLMEngine, SamplingParams
from serval.config import EngineConfig, SpeculativeConfig
from serval.layers import cpu_kernels
from serval.layers.linear import BF16_DOT_FORMATS, BlockQuantLinear, _as_floats, use_activation_quantization
from serval.model.llama import use_cpu_layers
from serval.platform_info import describe_hardware

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
BUILDS = ("base", "new")


def build_revision(rev: str):
    """The CPU kernels of git revision ``rev``, built with this checkout's flags under their own name."""
    root = Path(__file__).resolve().parents[1]
    csrc = "serval/layers/csrc"
    names = [s.name for s in cpu_kernels.SOURCES + cpu_kernels.HEADERS]
    texts = {n: subprocess.run(["git", "-C", str(root), "show", f"{rev}:{csrc}/{n}"], check=True,
                               capture_output=True).stdout for n in names}
    cflags = cpu_kernels.CFLAGS
    digest = hashlib.sha256(b"".join(texts.values()) + " ".join(cflags + [torch.__version__]).encode()).hexdigest()
    kind = torch.backends.cpu.get_cpu_capability().lower()
    name = f"serval_cpu_kernels_{kind}_{digest[:10]}"  # that revision's own build, where a checkout of it made one
    if not (cpu_kernels.build_directory(name) / f"{name}.so").is_file():
        name = f"serval_ab_base_{digest[:10]}"
    build_dir = cpu_kernels.build_directory(name)
    built = build_dir / f"{name}.so"
    if not built.is_file():
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        source_dir = Path(tempfile.mkdtemp(prefix="serval_ab_"))
        for n, text in texts.items():
            (source_dir / n).write_bytes(text)
        print(f"building {rev}'s kernels as {name} ...", flush=True)
        return load(name=name, sources=[str(source_dir / s.name) for s in cpu_kernels.SOURCES],
                    extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    spec = importlib.util.spec_from_file_location(name, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alternate_builds(builds: dict, run, rounds: int) -> tuple[float, float, bool]:
    """``run(kernels)`` (a list of tensors) by the "base" and "new" builds in turn, ``rounds`` times: the median wall
    seconds of each, and whether their last outputs are bitwise the same."""
    times: dict[str, list[float]] = {build: [] for build in builds}
    outputs = {}
    for _ in range(rounds):
        for build, kernels in builds.items():
            start = time.perf_counter()
            outputs[build] = run(kernels)
            times[build].append(time.perf_counter() - start)
    same = all(torch.equal(a, b) for a, b in zip(outputs["base"], outputs["new"]))
    return statistics.median(times["base"]), statistics.median(times["new"]), same


def use_build(model, kernels) -> None:
    """Rebuilds every BlockQuantLinear's kernel from ``kernels`` (its settings kept)."""
    for module in model.modules():
        if isinstance(module, BlockQuantLinear) and module.kernel is not None:
            module._build_kernel(kernels)


def parts(layer: BlockQuantLinear) -> list[tuple]:
    """A layer's parts as the kernel functions take them: (panels, scales, format, out_features)."""
    return [(getattr(layer, f"panels{i}"), _as_floats(getattr(layer, f"panel_scales{i}"), fmt), fmt, out_features)
            for i, (fmt, out_features) in enumerate(zip(layer.formats, layer.part_features))]


def multiply(kernels, setting: str, fmt: str):
    """The kernel function a part of format ``fmt`` runs under ``setting``."""
    if setting == "int8":
        return kernels.block_panel_linear_int8
    if setting == "bf16" and fmt in BF16_DOT_FORMATS and kernels.block_bf16_dot_kernel_available():
        return kernels.block_panel_linear_bf16_dot
    return kernels.block_panel_linear


def thread_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def bench_linears(model, builds: dict, rows_list: list[int], dtype: torch.dtype, rounds: int,
                  settings: list[str]) -> None:
    shapes: dict[tuple[int, int], list[BlockQuantLinear]] = {}
    for module in model.modules():
        if isinstance(module, BlockQuantLinear) and module.kernel is not None:
            shapes.setdefault((module.out_features, module.in_features), []).append(module)
    print(f"{'N x K':>12}{'layers':>7}{'act':>6}" + "".join(f"{r:>20}" for r in rows_list)
          + "   (us a call, base -> new)")
    for (n, k), layers in shapes.items():
        for setting in settings:
            cells = []
            for rows in rows_list:
                x = torch.randn(rows, k).to(dtype)
                found = {b: [] for b in BUILDS}
                repeats = max(3, min(40, int(4e6 / (n * k * len(layers) * rows))))
                for _ in range(rounds):
                    for build in BUILDS:
                        kernels = builds[build]

                        def call(kernels=kernels, x=x, layers=layers, setting=setting):
                            for layer in layers:
                                for panels, scales, fmt, out_features in parts(layer):
                                    multiply(kernels, setting, fmt)(x, panels, scales, fmt, out_features,
                                                                    layer.float_output)
                        call()
                        found[build].append(thread_seconds(call, repeats) / len(layers))
                a, b = (statistics.median(found[s]) * 1e6 for s in BUILDS)
                cells.append(f"{a:8.1f} ->{b:8.1f}")
            print(f"{f'{n}x{k}':>12}{len(layers):>7}{setting:>6}" + "".join(f"{c:>20}" for c in cells), flush=True)


def bench_decode(engine: LLMEngine, builds: dict, setting: str, steps: int, rounds: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    use_activation_quantization(engine.model, setting)
    found = {b: [] for b in BUILDS}
    tokens = {}
    for i in range(rounds):
        for build in BUILDS:
            use_build(engine.model, builds[build])
            engine.add_request(f"{build}-{setting}-{i}", PROMPT, params)
            engine.step()  # the prefill
            times, ids = [], []
            while engine.has_unfinished_requests():
                start = time.thread_time()
                outputs = engine.step()
                times.append(time.thread_time() - start)
                ids = outputs[-1].outputs[0].token_ids if outputs else ids
            found[build].append(statistics.median(times))
            tokens[build] = list(ids)
    a, b = (statistics.median(found[s]) * 1e3 for s in BUILDS)
    runs = ", ".join(f"{x * 1e3:.2f}/{y * 1e3:.2f}" for x, y in zip(found["base"], found["new"]))
    print(f"one-row decode step, activations {setting} (median of {rounds} x {steps} steps, CPU ms): base {a:.2f}, "
          f"new {b:.2f} ({a / b:.3f}x; rounds base/new {runs}); greedy tokens identical: "
          f"{tokens['base'] == tokens['new']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="git revision whose csrc/ is the baseline")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--settings", default="bf16,fma,int8", help="the ways of multiplying to time (comma-separated)")
    parser.add_argument("--no-linears", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe_hardware()}; 1 thread; base {args.base}")
    builds = {"base": build_revision(args.base), "new": cpu_kernels.load()}
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", quantization="gguf",
                          speculative=SpeculativeConfig(method=None))
    engine = LLMEngine(config)
    use_cpu_layers(engine.model, False)  # the layers on the Python path: a C++ layer holds one build's kernels
    with torch.inference_mode():
        if not args.no_linears:
            bench_linears(engine.model, builds, [int(r) for r in args.rows.split(",")], config.torch_dtype,
                          args.rounds, args.settings.split(","))
    if not args.no_decode:
        for setting in ("none", "int8"):
            bench_decode(engine, builds, setting, args.steps, args.rounds)


if __name__ == "__main__":
    main()
