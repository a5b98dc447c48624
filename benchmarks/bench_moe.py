"""A mixture-of-experts model's decode step against a dense model with the same active parameters, one run.

    .venv/bin/python benchmarks/bench_moe.py [--rows 16] [--steps 30] [--dtype auto] [--threads N]

Both models are the Llama decoder with random weights, built from a ModelConfig (no files): hidden 512, 4 layers,
8 query / 2 KV heads, vocabulary 8192. The MoE model's MLPs are 8 experts of width 768 with 2 chosen per token
(layers/moe.py); the dense model's MLP is 2 x 768 = 1536 wide, so that a token meets the same number of weights in
both. Each step decodes ``--rows`` requests that already hold 64 tokens of context (so attention is the same in
both); the step time is the median over ``--steps`` steps, the dense and MoE models' steps taken in turn (so that
both see the same load on the machine). What the MoE step pays beyond the dense one: the router, grouping the
(token, slot) pairs by expert, one matmul per expert over its few rows, and reading 8 experts' weights instead of one
MLP's once the batch covers them all. Four weight forms, A/B in one process: F.linear with each matmul padded to
its probed row count; load_model's choice (layers/linear.py ``lay_out_for_cpu_kernels``: the experts and float32
matrices on the CPU kernel, with no padding, bfloat16 Linears too unless oneDNN has AMX), with the experts in the
PyTorch loop over experts (layers/moe.py ``grouped_slots``) and in one C++ call (csrc/moe_experts.cpp, what
load_model's model runs); every matrix on the kernel. With ``--threads 1`` the time is this thread's CPU time
(time.thread_time), which other work on the machine disturbs less. Not a timed test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serval.config import EngineConfig  # noqa: E402
from serval.engine.request import Request  # noqa: E402
from serval.engine.runner import ModelRunner  # noqa: E402
from serval.engine.scheduler import SchedulerOutput  # noqa: E402
from serval.layers.linear import lay_out_for_cpu_kernels, probe_row_padding  # noqa: E402
from serval.layers.moe import Experts  # noqa: E402
from serval.model.config import ModelConfig  # noqa: E402
from serval.model.llama import LlamaForCausalLM  # noqa: E402
from serval.platform_info import describe_hardware  # noqa: E402
from serval.sampling_params import SamplingParams  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
             max_position=1024, tie_word_embeddings=False)
EXPERTS, TOP_K, EXPERT_WIDTH, CONTEXT, BLOCK = 8, 2, 768, 64, 16


def build(config: ModelConfig, dtype: torch.dtype, kernel: bool | None, loop: bool = False) -> LlamaForCausalLM:
    """``kernel``: False, F.linear padded; None, load_model's choice (lay_out_for_cpu_kernels); True, every matrix on
    the kernel. ``loop``: the experts in layers/moe.py's PyTorch loop, not csrc/moe_experts.cpp's one call."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    model = model.to(dtype).eval()
    fresh = type(model.rotary)(*model.rotary.args)  # the rotary tables stay float32, as load_model keeps them
    model.rotary.cos, model.rotary.sin = fresh.cos, fresh.sin
    laid = 0 if kernel is False else lay_out_for_cpu_kernels(model, bfloat16_linears=kernel)
    print(f"{laid} weights laid out for the CPU kernel", end="; ")
    probe_row_padding(model, dtype)
    for module in model.modules():
        if loop and isinstance(module, Experts):
            module.kernels = None  # SparseMoE then takes grouped_slots
    return model


def step_batch(runner: ModelRunner, rows: int, computed: int, tokens: list[list[int]]):
    """The runner's flat batch for ``rows`` requests with ``computed`` tokens cached and their next tokens."""
    out = SchedulerOutput()
    blocks_each = -(-(CONTEXT + 1) // BLOCK)
    for i in range(rows):
        new = tokens[i][computed:] if computed == 0 else tokens[i][computed: computed + 1]
        request = Request(f"r{i}", tokens[i][: computed + len(new)], SamplingParams(max_tokens=1), max_tokens=1,
                          num_computed_tokens=computed, block_ids=list(range(i * blocks_each, (i + 1) * blocks_each)))
        out.scheduled.append(request)
        out.num_scheduled_tokens[request.request_id] = len(new)
    return runner.prepare_inputs(out)


@torch.inference_mode()
def decode_step_ms(models: dict[str, LlamaForCausalLM], dtype: torch.dtype, rows: int, steps: int) -> dict[str, float]:
    """Each model's median decode step, the models' steps taken in turn, so that all see the same load on the
    machine."""
    blocks_each = -(-(CONTEXT + 1) // BLOCK)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (rows, CONTEXT + 1), generator=gen).tolist()
    decodes = {}
    for key, model in models.items():
        runner = ModelRunner(model, rows * blocks_each, BLOCK, dtype, "cpu")
        prefill = step_batch(runner, rows, 0, [t[:CONTEXT] for t in tokens])
        model(prefill.input_ids, prefill.positions, runner.kv_cache, prefill.meta)
        # the same decode step, rewritten in place each time
        decodes[key] = (model, runner.kv_cache, step_batch(runner, rows, CONTEXT, tokens))
    times = {key: [] for key in models}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for _ in range(steps + 3):
        for key, (model, kv_cache, decode) in decodes.items():
            start = clock()
            hidden = model(decode.input_ids, decode.positions, kv_cache, decode.meta)
            model.compute_logits(hidden)
            times[key].append(clock() - start)
    return {key: 1000 * statistics.median(t[3:]) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16, help="requests decoded per step")
    parser.add_argument("--steps", type=int, default=30, help="steps timed (after 3 warm-up steps)")
    parser.add_argument("--dtype", default="auto", help="auto (the engine's default on this CPU), bfloat16, float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = EngineConfig(dtype=args.dtype).torch_dtype
    print(f"machine: {describe_hardware()}", flush=True)
    dense = ModelConfig(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH)
    moe = ModelConfig(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                      moe_intermediate_size=EXPERT_WIDTH, moe_layers=list(range(SHAPE["num_layers"])))
    forms = (("F.linear padded", False, False), ("load_model's choice, experts looped in PyTorch", None, True),
             ("load_model's choice", None, False), ("all on the kernel", True, False))
    for form, kernel, loop in forms:
        models, weights = {}, {}
        for name, config in (("dense", dense), ("moe", moe)):
            models[name] = build(config, dtype, kernel, loop)
            # Every weight is read each step: at 16 rows x 2 slots over 8 experts, all experts are chosen (7.9
            # expected).
            weights[name] = sum(p.numel() for p in models[name].parameters()) - models[name].embed_tokens.weight.numel()
        print()
        results = decode_step_ms(models, dtype, args.rows, args.steps)
        for name in models:
            print(f"{form}: {name:>5}: decode step at {args.rows} rows {results[name]:.2f} ms ({dtype}), "
                  f"{weights[name] / 1e6:.1f}M weights read", flush=True)
        print(f"{form}: MoE / dense (same active parameters): {results['moe'] / results['dense']:.2f}x the step "
              f"time, {weights['moe'] / weights['dense']:.2f}x the weights read (a memory-bound step's floor)")

if __name__ == "__main__":
    main()
