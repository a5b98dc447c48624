"""Each speculative proposer offline, one request at a time: acceptance and tokens/s against no speculation.

Greedy chat through `LLM.chat` on the same workloads as `run_peers.py`'s grounded-1 and chat-1 (chat answers
that quote or edit a given text; ShareGPT first turns), 4 requests each, in the default configuration (dtype
auto, GGUF blocks) with one proposer at a time on one set of weights. Prints, per proposer and workload: output
tokens/s and its ratio to no speculation, guesses accepted / checked, and tokens per verifying step. Also checks
that every proposer's greedy tokens equal those without speculation.

    .venv/bin/python benchmarks/bench_spec_proposers.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serval.platform_info import describe_hardware  # noqa: E402

PROPOSERS = [None, "ngram", "self-layers:20", "self-int4", "smollm2-135m-instruct"]


def main() -> None:
    from serval import SamplingParams
    from serval.benchmark.workloads import WorkloadConfig, build_requests
    from serval.config import CacheConfig, EngineConfig, SpeculativeConfig
    from serval.engine.engine import LLMEngine
    from serval.engine.llm import LLM

    print(f"machine: {describe_hardware()}", flush=True)
    workloads = {name: build_requests(WorkloadConfig(kind, 4, (80, 160) if kind == "grounded" else (10, 200),
                                                     (64, 256), seed=seed))
                 for name, kind, seed in (("grounded-1", "grounded", 5), ("chat-1", "sharegpt", 7))}
    base = LLM()
    model, tokenizer = base.engine.model, base.engine.tokenizer
    reference: dict[str, list] = {}
    print(f"{'proposer':<24} {'workload':<11} {'tok/s':>7} {'vs off':>7} {'accepted':>14} {'tok/step':>9} same")
    for method in PROPOSERS:
        config = EngineConfig(cache=CacheConfig(num_blocks=1024), speculative=SpeculativeConfig(method=method))
        llm = LLM.from_engine(LLMEngine(config, model=model, tokenizer=tokenizer))
        for name, requests in workloads.items():
            stats = llm.engine.stats
            before = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
            tokens, outputs, start = 0, [], time.perf_counter()
            for r in requests:  # one stream: each request alone
                out = llm.chat(r.chat_messages(), SamplingParams(temperature=0, max_tokens=r.max_tokens),
                               use_tqdm=False)[0].outputs[0]
                outputs.append(out.token_ids)
                tokens += len(out.token_ids)
            rate = tokens / (time.perf_counter() - start)
            drafts, checked, accepted = (after - b for after, b in zip(
                (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens), before))
            if method is None:
                reference[name] = (outputs, rate)
            ref_outputs, ref_rate = reference[name]
            share = f"{accepted}/{checked} {accepted / checked:.0%}" if checked else "-"
            per_step = f"{1 + accepted / drafts:.2f}" if drafts else "-"
            print(f"{method or 'off':<24} {name:<11} {rate:>7.1f} {rate / ref_rate:>6.2f}x {share:>14} "
                  f"{per_step:>9} {'yes' if outputs == ref_outputs else 'NO'}", flush=True)
        del llm


if __name__ == "__main__":
    main()
