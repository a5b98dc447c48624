"""Where an offline decode step's time goes outside the linear kernels: the engine's step at B concurrent greedy
decodes (speculation off), each part timed by the thread's CPU clock around it, medians of many steps.

    .venv/bin/python benchmarks/bench_step_cost.py [--batch 1 16] [--steps 200] [--threads 1] [--enforce-eager] \
        [--model FILE] [--wall] [--layer-calls-ab] [--activation-quantization int8]

One thread by default: on a shared machine, CPU time of one thread is what other processes disturb least.
Parts: the block linears of the layers, the head (logits of the sampled rows), attention (KV write and attend),
RMSNorm with the residual add, RoPE, SiLU-and-mul, the embedding lookup, the argmax, and the rest of the step
(scheduler, runner, output processing in Python, and small aten ops), each in ms a step. By default the layers run
as the engine runs them (a Llama's or Gemma's all in one C++ call, model/llama.py ``cpu_layers``; others one C++
call each, ``cpu_layer``), timed as one part, "layers"; with --enforce-eager each kernel is called from Python and
timed as its part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from serval import LLMEngine, SamplingParams
from serval.config import EngineConfig, SpeculativeConfig
from serval.platform_info import describe_hardware

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


class PartTimer:
    """Adds the time spent in each wrapped callable to its part (outermost call only), by ``clock``: the thread's CPU
    time by default."""

    def __init__(self, clock=time.thread_time) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.depth = 0
        self.clock = clock

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[part] += self.clock() - start
                self.depth -= 1
        return timed


def instrument(engine: LLMEngine, timer: PartTimer) -> None:
    import serval.engine.runner as runner_module
    import serval.model.llama as llama
    from serval.layers.rotary import RotaryStep

    model = engine.core.runner.model
    for name, module in model.named_modules():
        if name == "lm_head":
            module.forward = timer.wrap("head", module.forward)
        elif name.endswith(("_proj", "gate_up_proj", "down_proj")) and hasattr(module, "forward"):
            module.forward = timer.wrap("linears", module.forward)
        elif name.endswith(("layernorm", "norm")):
            module.forward = timer.wrap("norms", module.forward)
        elif name == "embed_tokens":
            module.forward = timer.wrap("embedding", module.forward)
    llama.paged_attention = timer.wrap("attention", llama.paged_attention)
    llama.silu_and_mul = timer.wrap("silu_and_mul", llama.silu_and_mul)
    RotaryStep.rotate_ = timer.wrap("rope", RotaryStep.rotate_)
    runner_module.greedy_token_tensor = timer.wrap("argmax", runner_module.greedy_token_tensor)


def start_decodes(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", PROMPT + f" number {i}", params)
    while engine.core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in engine.core.scheduler.running):
        engine.step()
    engine.step()


def measure(engine: LLMEngine, batch: int, steps: int, instrumented: PartTimer | None,
            clock=time.thread_time) -> dict:
    start_decodes(engine, batch, steps + 8)
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        if instrumented is not None:
            instrumented.totals.clear()
        start = clock()
        engine.step()
        total = clock() - start
        per_step["step"].append(total)
        if instrumented is not None:
            for part, seconds in instrumented.totals.items():
                per_step[part].append(seconds)
            per_step["rest"].append(total - sum(instrumented.totals.values()))
    while engine.has_unfinished_requests():
        engine.step()
    return {part: round(1000 * statistics.median(values), 3) for part, values in per_step.items()}


def compare_layer_calls(engine: LLMEngine, batch: int, steps: int, clock, block: int = 15) -> dict:
    """Whole steps with the layers in one C++ call (model/llama.py ``cpu_layers``) against one call per layer
    (each layer's ``cpu_layer``), alternated in blocks of ``block`` steps on the same decodes: medians in ms."""
    model = engine.core.runner.model
    in_one_call = model._cpu_layers
    start_decodes(engine, batch, steps + 8)
    per_mode: dict[str, list[float]] = {"one call per layer": [], "layers in one call": []}
    try:
        for i in range(steps // block):
            mode = "layers in one call" if i % 2 else "one call per layer"
            model._cpu_layers = in_one_call if i % 2 else (lambda *args: None)
            for _ in range(block):
                start = clock()
                engine.step()
                per_mode[mode].append(clock() - start)
    finally:
        del model._cpu_layers  # the class's method again
    while engine.has_unfinished_requests():
        engine.step()
    medians = {mode: round(1000 * statistics.median(times), 3) for mode, times in per_mode.items()}
    return {**medians, "ratio": round(medians["one call per layer"] / medians["layers in one call"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-parts", action="store_true", help="time whole steps only (no wrappers)")
    parser.add_argument("--enforce-eager", action="store_true", help="each kernel called from Python, timed apart")
    parser.add_argument("--model", default=None, help="a model file or name (default: the embedded default)")
    parser.add_argument("--wall", action="store_true",
                        help="time by the wall clock, not the thread's CPU time (with more than one thread, the "
                             "main thread's CPU time leaves out what it waits for)")
    parser.add_argument("--activation-quantization", default=EngineConfig.activation_quantization,
                        help="EngineConfig.activation_quantization: none or int8")
    parser.add_argument("--layer-calls-ab", action="store_true",
                        help="whole steps with the layers in one call against one call per layer, alternated")
    args = parser.parse_args()
    clock = time.perf_counter if args.wall else time.thread_time
    torch.set_num_threads(args.threads)
    print(f"machine: {describe_hardware()}", flush=True)
    engine = LLMEngine(EngineConfig(model=args.model, speculative=SpeculativeConfig(method=None),
                                    enforce_eager=args.enforce_eager,
                                    activation_quantization=args.activation_quantization))
    if args.layer_calls_ab:
        measure(engine, 1, 8, None, clock)  # warm-up: builds the layers' one-call forms
        for batch in args.batch:
            print(json.dumps({"batch": batch, "ms_per_step": compare_layer_calls(engine, batch, args.steps, clock)}),
                  flush=True)
        return
    timer = None if args.no_parts else PartTimer(clock)
    if timer is not None:
        instrument(engine, timer)
    measure(engine, 1, 8, timer, clock)  # warm-up: the layers' one-call forms are built in its first step
    model = engine.core.runner.model
    if timer is not None and not args.enforce_eager and getattr(model, "cpu_layers", None) is not None:
        forms, cpu_layers = model.cpu_layers  # the layers in one call (model/llama.py LlamaLayers)
        model.cpu_layers = (forms, timer.wrap("layers", cpu_layers))
    elif timer is not None and not args.enforce_eager:
        for layer in model.layers:
            layer.cpu_layer = timer.wrap("layers", layer.cpu_layer)
    for batch in args.batch:
        print(json.dumps({"batch": batch, "ms_per_step": measure(engine, batch, args.steps, timer, clock)}), flush=True)


if __name__ == "__main__":
    main()
