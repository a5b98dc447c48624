"""Dense (bfloat16, float32) linears on the CPU: F.linear padded to its probed row count (layers/linear.py
``row_padding``, what a Linear did before its weight was laid out for the kernel) against the C++ kernel on the
weight laid out as W^T (``lay_out_for_cpu_kernels``: no padding), A/B in one process.

    .venv/bin/python benchmarks/bench_dense_linear.py [--threads 1] [--repeats 50]

CPU time of this thread (time.thread_time) per call, median of ``--repeats``; one thread by default, so that other
work on the machine costs little of the figure. Not a timed test.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serval.layers.linear import Linear, lay_out_for_cpu_kernels, padded_matmul, row_padding  # noqa: E402
from serval.platform_info import describe_hardware  # noqa: E402

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # [out, in]: SmolLM2-135M's qkv, gate/up and down
ROWS = (1, 4, 16, 64, 256)


def median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_hardware(), f"threads {args.threads}")
    print("dtype     shape (out x in)  pad | " + " ".join(f"{f'{r} rows':>21}" for r in ROWS))
    for dtype in (torch.bfloat16, torch.float32):
        for out_features, in_features in SHAPES:
            gen = torch.Generator().manual_seed(0)
            weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
            padding = row_padding(functools.partial(F.linear, weight=weight), in_features,
                                  ("dense", out_features, in_features), dtype, torch.device("cpu"))
            layer = Linear(in_features, out_features)
            layer.weight.data = weight.clone()
            assert lay_out_for_cpu_kernels(layer, bfloat16_linears=True) == 1
            cells = []
            for rows in ROWS:
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                before = median_us(functools.partial(padded_matmul, functools.partial(F.linear, weight=weight), x,
                                                     padding), args.repeats)
                after = median_us(functools.partial(layer, x), args.repeats)
                cells.append(f"{before:8.0f} {after:7.0f} {before / after:4.1f}x")
            print(f"{str(dtype).removeprefix('torch.'):9} {out_features:5} x {in_features:<5} {padding:>6} | "
                  + " ".join(cells))
    print("cells: F.linear padded us, kernel us, ratio")


if __name__ == "__main__":
    main()
