"""Gemma 3 270M Q4_K_M, one stream, greedy, speculation off: the decode step with Gemma's fused C++ norm and GeGLU
on and off, alternated in one process (off: the PyTorch lines, as where the kernels would not give their bits).

    python benchmarks/bench_gemma_step.py [--rounds 4] [--tokens 24] [--threads 1] [--cpu-time]

--cpu-time times each step by the process's CPU time instead of the wall clock: on a machine others load, with one
thread, the figure that stays put. Prints the median, p10 and p90 a mode, the aten ops of one decode step, and
whether both modes gave the same greedy tokens."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from serval.config import EngineConfig, SpeculativeConfig
from serval.engine.engine import LLMEngine
from serval.layers import activation, norm
from serval.layers.embedding import embedding_dtype
from serval.sampling_params import SamplingParams

CHAT = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model="gemma3-270m", speculative=SpeculativeConfig(method=None)))
    print(f"dtype {embedding_dtype(engine.model.embed_tokens)}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    fused_widths = (norm.exact_sum_lanes, activation.exact_gelu_lanes)
    clock = time.process_time if args.cpu_time else time.perf_counter

    def use_fused(fused: bool) -> None:
        norm.exact_sum_lanes, activation.exact_gelu_lanes = fused_widths if fused else (lambda *a: None,) * 2

    def run(request_id: str, tokens: int) -> tuple[list[float], list[int]]:
        engine.add_request(request_id, CHAT, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        times, token_ids = [], []
        while engine.has_unfinished_requests():
            start = clock()
            outputs = engine.step()
            times.append(clock() - start)
            token_ids = next((o.outputs[0].token_ids for o in outputs if o.finished), token_ids)
        return times[1:], token_ids  # the decode steps (the first step is the prefill)

    steps, answers = {True: [], False: []}, {}
    for r in range(args.rounds):
        for fused in (True, False) if r % 2 == 0 else (False, True):
            use_fused(fused)
            times, token_ids = run(f"{r}-{fused}", args.tokens)
            steps[fused] += times
            answers.setdefault(fused, token_ids)
    for fused in (False, True):
        use_fused(fused)
        engine.add_request(f"ops-{fused}", CHAT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        engine.step(), engine.step()
        with torch.profiler.profile() as prof:
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        t = [1e3 * s for s in sorted(steps[fused])]
        print(f"{'fused' if fused else 'pytorch'}: median {statistics.median(t):.2f} ms, p10 {t[len(t) // 10]:.2f}, "
              f"p90 {t[9 * len(t) // 10]:.2f}, {len(t)} steps; {ops} aten ops a step")
    print("same greedy tokens:", answers[True] == answers[False])


if __name__ == "__main__":
    main()
