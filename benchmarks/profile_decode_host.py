"""Where the host's time goes in decode steps: cProfile over engine.step() at each stream count, on the engine's
defaults for the device (on a GPU: CUDA graphs, async output processing). On a GPU the step is the host's once the
graph is launched, so this is the profile that says what to cut next (benchmarks/README.md, "On a GPU").

    python benchmarks/profile_decode_host.py [STREAMS ...] [--steps 50] [--top 25]

Prints, per stream count, the unprofiled and profiled step times and the functions by own time and by cumulative
time. Greedy requests of 200 tokens, EOS ignored; the steps profiled are decode-only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from serval.config import EngineConfig
from serval.engine.engine import LLMEngine
from serval.platform_info import describe_hardware
from serval.sampling_params import SamplingParams


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("streams", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(f"machine: {describe_hardware()}", flush=True)
    engine = LLMEngine(EngineConfig())
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for streams in args.streams:
        ids = [f"s{streams}-{i}" for i in range(streams)]
        for request_id in ids:
            engine.add_request(request_id, f"Tell me a story about the cat called {request_id}.", params)
        timed_steps(engine, 20)  # every prompt computed: the steps from here on are decodes
        profiler = cProfile.Profile()
        profiled_ms = timed_steps(engine, args.steps, profiler)
        plain_ms = timed_steps(engine, args.steps)
        print(f"=== {streams} streams: {plain_ms:.3f} ms a step unprofiled, {profiled_ms:.3f} ms profiled")
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
