"""`serval bench throughput`: offline generation speed of the in-process engine on a batch of prompts, and of
Hugging Face transformers on the same weights and prompts, in one run (only ratios from one run compare: a shared
machine's speed drifts between runs).

    serval bench throughput --num-prompts 16 --output-tokens 128 [--dtype bfloat16] [--quantization none]

Both generate greedily exactly ``--output-tokens`` tokens per prompt (EOS ignored) after a short warm-up;
tokens/s is generated tokens over wall time, prompt processing included.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from serval.benchmark.workloads import parse_range, prose
from serval.config import QUANTIZATION_CHOICES


def run_serval(args: argparse.Namespace, prompts: list[str]) -> tuple[dict, object]:
    from serval.engine.llm import LLM
    from serval.model.loader import resolve_quantization
    from serval.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    load_s = time.perf_counter() - start
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    config, path = llm.engine.config, llm.engine.model_path
    dtype = str(config.torch_dtype).removeprefix("torch.")  # "auto" resolved, as the engine did
    quantization = resolve_quantization(path, config.device, config.torch_dtype, config.quantization)
    return ({"dtype": dtype, "quantization": quantization, "load_s": load_s,
             "generated_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed},
            llm.engine.model_path)


def run_transformers(model_path: Path, dtype: str, device: str, prompts: list[str], output_tokens: int) -> dict:
    """transformers' batched greedy ``generate`` (left padding) on the same GGUF or Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    where = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    directory = str(model_path.parent if where else model_path)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left", **where)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **where).to(device).eval()
    load_s = time.perf_counter() - start
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    with torch.inference_mode():
        model.generate(**tokenizer(prompts[:1], return_tensors="pt").to(device), max_new_tokens=4, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)  # warm-up
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=output_tokens, min_new_tokens=output_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch.input_ids.shape[1]) * out.shape[0]
    return {"dtype": dtype, "load_s": load_s, "generated_tokens": generated, "seconds": elapsed,
            "tokens_per_s": generated / elapsed}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="embedded model name, .gguf file or HF directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="Serval's dtype; transformers runs in the dtype it resolves to")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                        help="Serval's weights: auto (a GGUF's quantized blocks as stored, on the CPU), none "
                        "(dequantized), gguf, int8 (weight-only)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts generated as one batch")
    parser.add_argument("--input-words", default="10:40", help="prompt length range in words, LOW:HIGH")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument("--hf-dtype", default=None, choices=["bfloat16", "float32", "float16"],
                        help="transformers' dtype (default: the one Serval resolved to). Recent transformers keep "
                        "a GGUF's weights packed and say float32 is their fast path for it")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from serval.platform_info import describe_hardware

    rng = random.Random(args.seed)
    low, high = parse_range(args.input_words)
    prompts = [prose(rng, rng.randint(low, high)) for _ in range(args.num_prompts)]
    machine = describe_hardware()
    print(f"machine: {machine}", flush=True)
    print(f"serval: {args.num_prompts} prompts x {args.output_tokens} tokens ...", flush=True)
    serval, model_path = run_serval(args, prompts)
    results = {"machine": machine, "num_prompts": args.num_prompts, "input_words": [low, high],
               "output_tokens": args.output_tokens, "model": str(model_path), "serval": serval}
    print(f"{'':<14}{'weights':>14}{'tokens':>9}{'seconds':>9}{'tok/s':>9}")
    form = serval["dtype"] + ("" if serval["quantization"] == "none" else "+" + serval["quantization"])
    print(f"{'serval':<14}{form:>14}"
          f"{serval['generated_tokens']:>9}{serval['seconds']:>9.2f}{serval['tokens_per_s']:>9.1f}", flush=True)
    if not args.no_hf:
        hf = run_transformers(Path(model_path), args.hf_dtype or serval["dtype"], args.device, prompts,
                              args.output_tokens)
        results["transformers"] = hf
        results["serval_vs_transformers"] = serval["tokens_per_s"] / hf["tokens_per_s"]
        print(f"{'transformers':<14}{hf['dtype']:>14}{hf['generated_tokens']:>9}{hf['seconds']:>9.2f}"
              f"{hf['tokens_per_s']:>9.1f}")
        print(f"serval / transformers: {results['serval_vs_transformers']:.2f}x")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0
