"""Where the host's time goes in decode steps: cProfile over engine.step() at each stream count, on the engine's
defaults for the device (on a GPU: CUDA graphs, async output processing). On a GPU the step is the host's once the
graph is launched, so this is the profile that says what to cut next (benchmarks/README.md, "On a GPU").

    python benchmarks/profile_decode_host.py [STREAMS ...] [--steps 50] [--top 25] [--model M] \
        [--num-scheduler-steps N] [--max-num-batched-tokens N] [--async-scheduling] [--async-output-processing] \
        [--pad-decode-on-cpu]

Prints, per stream count, the unprofiled and profiled step times, the host's time a step split into its parts (the
scheduler, the front end, the model's calls; on a GPU those calls only launch work, on a CPU they are the compute,
so "outside the model" is the host's share there), and the functions by own time and by cumulative time. Greedy
requests long enough for every step timed, EOS ignored; the steps profiled are decode-only. The options set the
engine as on a GPU (multi-step runs, the token budget, async scheduling, async output processing, and the padded
decode buckets, uncaptured on a CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from bench_step_cost import PartTimer

from serval.config import EngineConfig, SchedulerConfig
from serval.engine.engine import LLMEngine
from serval.platform_info import describe_hardware
from serval.sampling_params import SamplingParams

WARMUP_STEPS = 20


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(engine: LLMEngine, steps: int, profiler: cProfile.Profile | None = None) -> float:
    synchronize()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        engine.step()
    if profiler is not None:
        profiler.disable()
    synchronize()
    return 1000 * (time.perf_counter() - start) / steps


def time_parts(engine: LLMEngine) -> PartTimer:
    """A wall-clock timer of the host's parts of a step: the scheduler's calls, the front end's output processing and
    the model's (forwards and logits)."""
    timer, core = PartTimer(clock=time.perf_counter), engine.core
    for part, owner, name in (("schedule", core.scheduler, "schedule"),
                              ("schedule_next_run", core.scheduler, "schedule_next_run"),
                              ("update_from_output", core.scheduler, "update_from_output"),
                              ("front end", engine.outputs, "process"),
                              ("model", core.model, "forward"), ("model", core.model, "compute_logits")):
        setattr(owner, name, timer.wrap(part, getattr(owner, name)))
    return timer


def parts_report(timer: PartTimer, steps: int, step_ms: float) -> str:
    parts = ", ".join(f"{part} {1000 * s / steps:.3f}" for part, s in sorted(timer.totals.items(),
                                                                            key=lambda kv: -kv[1]))
    outside = step_ms - 1000 * timer.totals.get("model", 0.0) / steps
    return f"host ms a step: {parts}; outside the model {outside:.3f} of {step_ms:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("streams", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--model", default=None, help="embedded model name, .gguf file or HF directory")
    parser.add_argument("--num-scheduler-steps", type=int, default=None, help="default: the device's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the device's")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--async-output-processing", action="store_true", default=None)
    parser.add_argument("--pad-decode-on-cpu", action="store_true")
    args = parser.parse_args()
    print(f"machine: {describe_hardware()}", flush=True)
    scheduler = SchedulerConfig(num_scheduler_steps=args.num_scheduler_steps, async_scheduling=args.async_scheduling,
                                async_output_processing=args.async_output_processing,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(EngineConfig(model=args.model, pad_decode_on_cpu=args.pad_decode_on_cpu, scheduler=scheduler))
    print(f"engine: {engine.config.scheduler}", flush=True)
    parts = time_parts(engine)
    # Tokens for the warm-up and both timed windows, each step up to num_scheduler_steps of them, and a few more.
    max_tokens = (WARMUP_STEPS + 2 * args.steps + 5) * engine.config.scheduler.num_scheduler_steps
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for streams in args.streams:
        ids = [f"s{streams}-{i}" for i in range(streams)]
        for request_id in ids:
            engine.add_request(request_id, f"Tell me a story about the cat called {request_id}.", params)
        timed_steps(engine, WARMUP_STEPS)  # every prompt computed: the steps from here on are decodes
        profiler = cProfile.Profile()
        profiled_ms = timed_steps(engine, args.steps, profiler)
        parts.totals.clear()
        plain_ms = timed_steps(engine, args.steps)
        print(f"=== {streams} streams: {plain_ms:.3f} ms a step unprofiled, {profiled_ms:.3f} ms profiled")
        print(parts_report(parts, args.steps, plain_ms))
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.top)
            print(text.getvalue())
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
