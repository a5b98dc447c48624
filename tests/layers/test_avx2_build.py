"""The CPU kernels' AVX2 build (``SERVAL_CPU_ISA=avx2``, what AVX2-only CPUs such as AMD EPYC Zen 2/3 run) gives
bitwise the outputs of this machine's build: the block linear (float32 and int8 activations), the dense linear, the
tiled attention and silu are written once over vectors of 8 or 16 lanes with the same arithmetic per output. On an
AVX-512 machine this is what tests the AVX2 paths; on an AVX2 machine it compares two AVX2 builds. Gemma's
gelu_tanh(gate) * up (SLEEF's tanh in 8 lanes or 16) and norm likewise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_block_quant_linear import FORMATS, activations, random_blocks

from serval.layers import cpu_kernels
from serval.layers.attention import KV_CODE_DTYPES, new_kv_cache

HERE = Path(__file__).parent
INT8_CASES = [*FORMATS, "Q4_K f32", "Q5_K f32", "Q6_K f32"]  # and the K-quants with float32 scales (q4f, q5f, q6f)
kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    kernels is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="needs the C++ kernels on a CPU with AVX2")


def outputs(k) -> dict[str, torch.Tensor]:
    """Every case, computed by the kernels module k: panel linears (tile remainders, both output roundings; block
    formats and dense bf16 and f32 weights),
    attention over a chunk of 70 queries with contexts 531-600 (head sizes 64, 128, 256; float32 and bfloat16 caches,
    and 8-bit caches of each code dtype with the bytes quantize_kv_ wrote; a sliding window of 100 keys, and with
    Gemma 2's soft-capping too),
    silu(gate) * up, and a row argmax with ties and NaN."""
    out = {}
    for fmt in FORMATS:  # q4, q8 and the GGUF types of the other layouts (q5, q4f, q5f, q6f)
        weight = random_blocks(fmt, 130, 576)
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 5, 7, 40):
                x = activations(rows, weight.in_features, dtype)
                out[f"linear {fmt} {dtype} {rows}"] = k.block_panel_linear(x, *weight.panels(), weight.format, 130,
                                                                           False)
    # Dense weights (W^T [590, 130]: a short last block of inputs and a short last column tile), bf16 and f32.
    dense = torch.randn(590, 130, generator=torch.Generator().manual_seed(5)) / 590**0.5
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 5, 7, 40):
            x = activations(rows, 590, dtype)
            out[f"dense linear {dtype} {rows}"] = k.dense_panel_linear(x, dense.to(dtype), False)
    for fmt in INT8_CASES:  # int8 activations: integer sums exact, the same float32 steps per output
        weight = random_blocks(fmt.split()[0], 130, 576)
        weight = weight.with_float32_scales() if fmt.endswith("f32") else weight
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 3, 40):
                x = activations(rows, weight.in_features, dtype)
                out[f"int8 {fmt} {dtype} {rows}"] = k.block_panel_linear_int8(x, *weight.panels(), weight.format,
                                                                             130, False)
    for head_dim in (64, 128, 256):
        gen = torch.Generator().manual_seed(head_dim)
        k_cache, v_cache = (torch.randn(48, 16, 3, head_dim, generator=gen) for _ in range(2))
        queries = torch.randn(70, 9, head_dim, generator=gen)
        table = torch.randperm(48, generator=gen)[:38][None]
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc = queries.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
            out[f"attention {head_dim} {dtype}"] = k.paged_attention(
                q, kc, vc, table, torch.zeros(70, dtype=torch.long), torch.arange(531, 601), head_dim**-0.5)
        out[f"attention {head_dim} window 100"] = k.paged_attention(  # a sliding window, first keys mid-tile
            queries, k_cache, v_cache, table, torch.zeros(70, dtype=torch.long), torch.arange(531, 601),
            head_dim**-0.5, 100)
        out[f"attention {head_dim} window 100 softcap 2"] = k.paged_attention(  # scores of several units: capped
            queries * 3, k_cache, v_cache, table, torch.zeros(70, dtype=torch.long), torch.arange(531, 601),
            head_dim**-0.5, 100, 2.0)
        for code_dtype in KV_CODE_DTYPES.values():  # 8-bit cache rows, written by the build's own quantize_kv_
            caches = [new_kv_cache(1, 48, 16, 3, head_dim, code_dtype, "cpu")[0, 0] for _ in range(2)]
            for cache, values in zip(caches, (k_cache, v_cache)):
                k.quantize_kv_(values.flatten(0, 1).to(torch.bfloat16), cache, torch.arange(48 * 16))
                out[f"quantize_kv_ {head_dim} {code_dtype}"] = cache.view(torch.uint8).clone()
            out[f"attention {head_dim} {code_dtype}"] = k.paged_attention(
                queries.to(torch.bfloat16), *caches, table, torch.zeros(70, dtype=torch.long), torch.arange(531, 601),
                head_dim**-0.5)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1536, 40):  # a row that ends mid-vector
            gate_up = torch.randn(5, 2 * n, generator=torch.Generator().manual_seed(n)) * 6
            out[f"silu_and_mul {n} {dtype}"] = k.silu_and_mul(gate_up.to(dtype))
            out[f"gelu_tanh_and_mul {n} {dtype}"] = k.gelu_tanh_and_mul(gate_up.to(dtype), 16)
        x = torch.randn(5, 640, generator=torch.Generator().manual_seed(6)).to(dtype)
        for lanes in (16, 8):  # Gemma's norm, its sum in the order of PyTorch's AVX-512 and AVX2 builds
            out[f"gemma_rms_norm {lanes} {dtype}"] = k.gemma_rms_norm(x, (x[0] / 4).contiguous(), 1e-6, lanes)[0]
    logits = torch.randn(6, 49155, generator=torch.Generator().manual_seed(3))
    logits[1, 100] = logits[1, 40000] = logits[1].max() + 1  # a tie: the first wins
    logits[2, 49153] = logits[2].max() + 1  # in the tail past the last full vector
    logits[3, 7] = logits[3, 30000] = float("nan")  # the first NaN wins, as torch.argmax
    out["argmax"] = k.argmax_rows(logits)
    return out


SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from serval.layers import cpu_kernels
from serval.layers.attention import KV_CODE_DTYPES, new_kv_cache
from test_avx2_build import outputs
k = cpu_kernels.load()
assert k.__name__.startswith("serval_cpu_kernels_avx2_") and k.block_panel_kernel_available(), k
assert k.block_int8_kernel_available(), k
torch.save(outputs(k), sys.argv[1])
"""


def test_the_avx2_build_gives_the_same_bits(tmp_path):
    env = {**os.environ, "SERVAL_CPU_ISA": "avx2"}
    subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "avx2.pt"), str(HERE)], check=True, env=env,
                   cwd=HERE.parents[1], timeout=900)
    avx2 = torch.load(tmp_path / "avx2.pt")
    native = outputs(kernels)
    # + 8 dense (bf16/f32 x 4 row counts), + 4 gelu, + 4 Gemma norm
    assert avx2.keys() == native.keys()
    assert len(native) == 8 * len(FORMATS) + 6 * len(INT8_CASES) + 8 + 11 + 3 + 3 + 3 * 3 * 2 + 4 + 4
    for case, want in native.items():
        assert torch.equal(avx2[case], want), case
    assert native["argmax"].tolist()[1:4] == [100, 49153, 7]
