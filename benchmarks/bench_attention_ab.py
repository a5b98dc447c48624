"""The paged attention kernel of this checkout against that of another git revision, in one process: the two builds
alternated call by call so that a slow spell of a shared machine hits both, and their outputs compared bit for bit.

    .venv/bin/python benchmarks/bench_attention_ab.py --base main [--threads 1 2] [--rounds 7] \
        [--one-stream-contexts 300 600 3000]

SmolLM2's attention (9 query heads, 3 key/value heads, head size 64, bfloat16 cache in blocks of 16), one layer:
- a prompt of 320 or 1500 tokens prefilled in chunks of 128 (every chunk over the keys before it);
- 16 decodes at contexts drawn from 100-700, alone and in one step with a 112-token prefill chunk at position 300
  (the mixed workload's step under the default token budget of 128).
And one stream of Llama-3.2-1B's attention (32 query heads, 8 key/value heads, head size 64): one decode at each of
--one-stream-contexts, through 16 layers' caches in turn, as a step reads them (from memory, not a cache's worth).
Microseconds of wall time per call (medians of the rounds), and the GFLOP/s of scores and weighted values.
"""

from __future__ import annotations

import argparse

import torch
from bench_kernel_ab import alternate_builds, build_revision

from serval.layers import cpu_kernels
from serval.platform_info import describe_hardware

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def attention_call(gen: torch.Generator, contexts: list[int], chunk: tuple[int, int] | None):
    """A step's paged_attention arguments: one decode per context, then a chunk (start, tokens) of one more
    sequence; returns (args, FLOPs of its scores and weighted values)."""
    sequences = contexts + ([chunk[0] + chunk[1]] if chunk else [])
    blocks = [(c + BLOCK - 1) // BLOCK for c in sequences]
    k_cache, v_cache = (torch.randn(sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
                        for _ in range(2))
    order = torch.randperm(sum(blocks) + 1, generator=gen)
    tables = torch.zeros(len(sequences), max(blocks), dtype=torch.long)
    used = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = order[used: used + count]
        used += count
    rows, lens = list(range(len(contexts))), list(contexts)
    if chunk:
        rows += [len(contexts)] * chunk[1]
        lens += list(range(chunk[0] + 1, chunk[0] + chunk[1] + 1))
    query = torch.randn(len(rows), HEADS, HEAD_DIM, generator=gen).bfloat16()
    args = (query, k_cache, v_cache, tables, torch.tensor(rows), torch.tensor(lens), HEAD_DIM**-0.5)
    return args, sum(lens) * HEADS * HEAD_DIM * 4


def prefill_calls(gen: torch.Generator, prompt: int, chunk: int = 128):
    """A prompt's chunks as calls over one cache: each chunk attends to every key before it and its own."""
    (query, k_cache, v_cache, tables, _, _, scale), _ = attention_call(gen, [], (0, prompt))
    calls, flops = [], 0
    for start in range(0, prompt, chunk):
        n = min(chunk, prompt - start)
        lens = torch.arange(start + 1, start + n + 1)
        calls.append((query[start: start + n].contiguous(), k_cache, v_cache, tables, torch.zeros(n, dtype=torch.long),
                      lens, scale))
        flops += int(lens.sum()) * HEADS * HEAD_DIM * 4
    return calls, flops


def one_stream_calls(gen: torch.Generator, context: int, layers: int = 16, heads: int = 32, kv_heads: int = 8):
    """One decode at ``context`` through ``layers`` caches of its own (blocks in random order), one call a layer."""
    blocks = (context + BLOCK - 1) // BLOCK
    query = torch.randn(1, heads, HEAD_DIM, generator=gen).bfloat16()
    calls = []
    for _ in range(layers):
        k_cache, v_cache = (torch.randn(blocks, BLOCK, kv_heads, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
        table = torch.randperm(blocks, generator=gen)[None]
        calls.append((query, k_cache, v_cache, table, torch.zeros(1, dtype=torch.long), torch.tensor([context]),
                      HEAD_DIM**-0.5))
    return calls, layers * context * heads * HEAD_DIM * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="the git revision to compare against")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--one-stream-contexts", type=int, nargs="*", default=[300, 600, 3000])
    args = parser.parse_args()
    builds = {"base": build_revision(args.base), "new": cpu_kernels.load()}
    print(f"machine: {describe_hardware()}; base {args.base} against this checkout", flush=True)
    gen = torch.Generator().manual_seed(0)
    decodes = [int(c) for c in torch.randint(100, 700, (16,), generator=gen)]
    cases = {f"prefill {n} tokens, chunks of 128": prefill_calls(gen, n) for n in (320, 1500)}
    for name, chunk in (("16 decodes", None), ("16 decodes + 112-token chunk", (300, 112))):
        call, flops = attention_call(gen, decodes, chunk)
        cases[name] = ([call], flops)
    for context in args.one_stream_contexts:
        cases[f"1B one stream at {context} tokens, 16 layers"] = one_stream_calls(gen, context)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (calls, flops) in cases.items():
            base, new, same = alternate_builds(
                builds, lambda kernels, calls=calls: [kernels.paged_attention(*call) for call in calls], args.rounds)
            print(f"{threads} thread(s), {name}: {base * 1e6:.0f} -> {new * 1e6:.0f} us ({flops / base / 1e9:.0f} -> "
                  f"{flops / new / 1e9:.0f} GFLOP/s, {base / new:.2f}x), bits {'equal' if same else 'DIFFER'}",
                  flush=True)


if __name__ == "__main__":
    main()
