"""One decode's linears of a model, in the layers' order, by this checkout's kernels against another revision's: the
two builds alternated round by round in one process, on the threads the engine would use, wall time, and their
outputs compared bit for bit.

    .venv/bin/python benchmarks/bench_linears_ab.py --model F.gguf --base HEAD [--multiply tiles|dots] [--rounds 11]

Each layer's q/k/v, o, gate/up and down parts (one call a part, as decoder_layers.cpp's PanelLinear makes them) for
one row of bfloat16 activations, every layer in turn: the weights come from memory, as in a one-stream decode step.
``tiles``: the bfloat16 dot products on AMX tiles (where the CPU has them), ``dots``: on the vector units. Prints the
medians in ms and the GB/s of the parts' bytes.
"""

from __future__ import annotations

import argparse

import torch
from bench_kernel_ab import alternate_builds, build_revision, parts

from serval import LLMEngine
from serval.config import EngineConfig, SpeculativeConfig
from serval.layers import cpu_kernels
from serval.platform_info import describe_hardware


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--multiply", choices=("tiles", "dots"), default="tiles")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    builds = {"base": build_revision(args.base), "new": cpu_kernels.load()}
    engine = LLMEngine(EngineConfig(model=args.model, speculative=SpeculativeConfig(method=None)))
    print(f"machine: {describe_hardware()}; base {args.base} against this checkout, {args.multiply}", flush=True)
    tiles = args.multiply == "tiles"
    if tiles and not builds["new"].bf16_dot_tiles_available():
        raise SystemExit("no AMX-BF16 tiles on this CPU: use --multiply dots")
    calls, weight_bytes = [], 0
    for layer in engine.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            x = torch.randn(1, linear.in_features).bfloat16()
            for panels, scales, fmt, out_features in parts(linear):
                calls.append((x, panels, scales, fmt, out_features, linear.float_output, tiles))
                weight_bytes += panels.numel() * panels.element_size() + scales.numel() * scales.element_size()
    with torch.inference_mode():
        base, new, same = alternate_builds(
            builds, lambda kernels: [kernels.block_panel_linear_bf16_dot(*call) for call in calls], args.rounds)
    print(f"{len(calls)} calls, {weight_bytes / 1e6:.0f} MB: {base * 1e3:.2f} -> {new * 1e3:.2f} ms "
          f"({weight_bytes / base / 1e9:.1f} -> {weight_bytes / new / 1e9:.1f} GB/s, {base / new:.2f}x), "
          f"bits {'equal' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
