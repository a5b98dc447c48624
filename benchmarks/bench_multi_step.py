"""Multi-step decoding (--num-scheduler-steps) A/B on the offline engine: tokens/s with 1, 4 and 8 forwards a step,
the device's defaults otherwise, on one set of weights, alternated in rounds in one process (only ratios from one
run mean anything). Workloads: one stream greedy, one stream sampled (seeded, temperature 0.2, top-p 0.9: the
embedded model's defaults) and 16 streams greedy, 128 tokens a request, EOS ignored.

    .venv/bin/python benchmarks/bench_multi_step.py [--device cpu] [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import time

from serval import LLMEngine, SamplingParams
from serval.config import EngineConfig, SchedulerConfig
from serval.platform_info import describe_hardware

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
STEP_COUNTS = (1, 4, 8)
WORKLOADS = ((1, False), (1, True), (16, False))  # (streams, sampled)


def tokens_per_s(engine: LLMEngine, streams: int, tokens: int, sampled: bool, label: str) -> float:
    params = SamplingParams(temperature=0.2, top_p=0.9, seed=1, max_tokens=tokens, ignore_eos=True) if sampled \
        else SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"{label}-{i}", f"{PROMPT} {i}", params)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    print(f"machine: {describe_hardware()}", flush=True)
    engines: dict[int, LLMEngine] = {}
    for steps in STEP_COUNTS:
        config = EngineConfig(device=args.device, scheduler=SchedulerConfig(num_scheduler_steps=steps))
        first = next(iter(engines.values()), None)
        engines[steps] = LLMEngine(config) if first is None else \
            LLMEngine(config, model=first.model, tokenizer=first.tokenizer)
    for steps, engine in engines.items():
        tokens_per_s(engine, 1, 8, False, f"warmup{steps}")
    print("| workload | " + " | ".join(f"{steps} forward{'s' if steps > 1 else ''} a step" for steps in STEP_COUNTS)
          + " |")
    print("|---|" + "---|" * len(STEP_COUNTS))
    for streams, sampled in WORKLOADS:
        rounds: dict[int, list[float]] = {steps: [] for steps in STEP_COUNTS}
        for round_index in range(args.rounds):
            for steps, engine in engines.items():
                label = f"s{streams}-{sampled}-{steps}-{round_index}"
                rounds[steps].append(tokens_per_s(engine, streams, args.tokens, sampled, label))
        name = f"{streams} stream{'s' if streams > 1 else ''}, {'sampled' if sampled else 'greedy'}"
        print(f"| {name} | " + " | ".join(" / ".join(f"{x:.1f}" for x in rounds[steps]) for steps in STEP_COUNTS)
              + " |", flush=True)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
