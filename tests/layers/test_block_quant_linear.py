"""The block kernel (GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the K-quants Q4_K / Q5_K / Q6_K read as stored):
equal to float64 on the file's weights up to float32 summation, the same for a row alone or among any others, and
lossless repacking (the same bits from its AVX2 and AVX-512 builds: test_avx2_build.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from serval.layers import cpu_kernels
from serval.layers import linear as linear_module
from serval.layers.linear import EXTRA_BITS, BlockQuantLinear, BlockWeight, padded_matmul
from serval.model.gguf_file import _to_block_weight

kernels = cpu_kernels.load()


# GGUF block types the kernel reads beside its own q4/q8 test layouts: bytes per block, offsets of float16 scales.
GGUF_BLOCKS = {"Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)), "Q4_K": (256, 144, (0, 2)),
               "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}
FORMATS = ["q4", "q8", *GGUF_BLOCKS]


def random_gguf_bytes(qtype: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF blocks [N, bytes per row]: random quants and sub-block scales, and float16 d (and dmin or m)
    of a trained layer's size."""
    block, size, halves = GGUF_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out_features, in_features // block, size), dtype=np.uint8)
    for i, offset in enumerate(halves):  # d, then dmin (K) or m (Q5_1)
        scale = 1e-4 if block == 256 else 3e-3
        value = rng.uniform(0.2, 1, (out_features, in_features // block, 1)) * scale * (-1 if i and block == 32 else 1)
        raw[..., offset: offset + 2] = value.astype(np.float16).view(np.uint8)
    return raw.reshape(out_features, -1)


def random_blocks(fmt: str, out_features: int, in_features: int, seed: int = 0) -> BlockWeight:
    """Valid random blocks: scales of a trained layer's size (weights ~0.05), every code used. ``fmt``: a kernel
    layout (q4, q8) or a GGUF type of GGUF_BLOCKS (whose in_features is rounded up to its block)."""
    if fmt in GGUF_BLOCKS:
        block = GGUF_BLOCKS[fmt][0]
        in_features = -(-in_features // block) * block
        raw = torch.from_numpy(random_gguf_bytes(fmt, out_features, in_features, seed))
        return _to_block_weight(fmt, raw.view(out_features, in_features // block, -1), in_features)
    g = torch.Generator().manual_seed(seed)
    groups = -(-in_features // 32)
    if fmt == "q4":
        packed = torch.randint(0, 256, (out_features, groups, 16), generator=g, dtype=torch.uint8)
        d = torch.rand(out_features, groups, 1, generator=g) * 0.01 + 0.001
        m = -8 * d * (0.5 + torch.rand(out_features, groups, 1, generator=g))
        scales = torch.cat([d, m], -1).half()
    else:
        packed = torch.randint(-127, 128, (out_features, groups, 32), generator=g, dtype=torch.int8).view(torch.uint8)
        scales = (torch.rand(out_features, groups, 1, generator=g) * 0.001 + 1e-4).half()
    return BlockWeight(fmt, packed, scales.view(torch.int16), in_features)


def activations(rows: int, in_features: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 30  # an outlier channel, as real activations have
    return x.to(dtype)


needs_panels = pytest.mark.skipif(kernels is None or not kernels.block_panel_kernel_available(),
                                  reason="the panel kernel needs the C++ kernels and AVX2 (with FMA, F16C) or AVX-512")


@needs_panels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 37])
@pytest.mark.parametrize("shape", [(200, 576), (37, 80)])  # a short last panel; a K the blocks pad
def test_panel_kernel_equals_the_dequantized_weights(fmt, dtype, rows, shape):
    """The panel kernel multiplies by the file's exact weights in float32 FMAs: against float64, the error is
    float32 summation (K * 2^-24 of sum |x w|, far under 1e-4 here) plus the output's rounding to x's dtype."""
    out_features = shape[0]
    weight = random_blocks(fmt, *shape)
    in_features = weight.in_features
    x = activations(rows, in_features, dtype)
    got = kernels.block_panel_linear(x, *weight.panels(), weight.format, out_features, False)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    w = weight.dequantize().double()
    want = x.double() @ w.T
    rounding = 2**-8 if dtype == torch.bfloat16 else 2**-24
    bound = 1e-4 * (x.double().abs() @ w.abs().T) + rounding * want.abs()
    assert torch.all((got.double() - want).abs() <= bound)
    # The kernel rounds to bfloat16 itself: exactly as torch rounds its float32 results.
    float_output = kernels.block_panel_linear(x, *weight.panels(), weight.format, out_features, True)
    assert float_output.dtype == torch.float32 and torch.equal(float_output.to(dtype), got)


@needs_panels
@pytest.mark.parametrize("fmt", FORMATS)
def test_panel_layout_holds_the_same_weights(fmt):
    """Panels are a re-layout without loss: decoding through the kernel with one-hot rows gives every weight."""
    weight = random_blocks(fmt, 70, 96)
    eye = torch.eye(weight.in_features)
    got = kernels.block_panel_linear(eye, *weight.panels(), weight.format, 70, False).T
    assert torch.equal(got, weight.dequantize())


@needs_panels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("float32_scales", [False, True])
def test_a_layer_keeps_only_its_panels_and_gives_back_the_same_blocks(fmt, float32_scales):
    """The weight is in memory once, as the kernel's panels (model/loader.py's budget: the file's size), and the
    blocks rebuilt from them are the given ones, bit for bit (70 rows: a short last panel)."""
    weight = random_blocks(fmt, 70, 512)
    if float32_scales:
        weight = weight.with_float32_scales()
    layer = BlockQuantLinear(weight)
    assert not hasattr(layer, "packed0") and layer.kernel is not None
    (back,) = layer.block_weights()
    assert back.format == weight.format and back.in_features == weight.in_features
    for got, want in ((back.packed, weight.packed), (back.scales, weight.scales),
                      (back.super_scales, weight.super_scales)):
        assert (got is None and want is None) or (got.dtype == want.dtype and torch.equal(got, want))
    kept = sum(b.numel() * b.element_size() for b in layer.buffers())
    stored = sum(t.numel() * t.element_size() for t in (weight.packed, weight.scales, weight.super_scales)
                 if t is not None)
    assert kept <= stored * 96 / 70  # rows padded to a multiple of 32 only


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("last_rows", [64, 40])
def test_the_panels_of_parts_are_the_panels_of_the_stacked_blocks(fmt, last_rows):
    """A fused q/k/v matrix's panels, written part by part, are the stacked blocks' (a last part of 40 rows: its
    last panel padded)."""
    parts = [random_blocks(fmt, rows, 512, seed=i) for i, rows in enumerate((96, 32, last_rows))]
    for got, want in zip(BlockWeight.panels_of(parts), BlockWeight.concat(parts).panels()):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@needs_panels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_each_row_is_the_same_whatever_the_batch(fmt, dtype):
    """Batch invariance with no padding at all: every row count from 1 to 40 (all the tile remainders)."""
    layer = BlockQuantLinear(random_blocks(fmt, 130, 576))  # 130 columns: a short last column tile
    x = activations(40, layer.in_features, dtype)
    alone = torch.cat([layer(x[i: i + 1]) for i in range(len(x))])
    assert layer.min_rows == 1
    for rows in range(1, 41):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@needs_panels
@torch.inference_mode()
def test_later_calls_use_the_kept_panels_and_give_the_same_bits(monkeypatch):
    """A layer of two parts in different formats builds each part's panels once, with the layer: calls of
    rows [M, in] build no BlockWeight and skip the reshape and padding, and give the bits of each part's own kernel
    call, side by side; other shapes still take the general path."""
    parts = [random_blocks("q4", 48, 96, seed=1), random_blocks("q8", 40, 96, seed=2)]
    layer = BlockQuantLinear(parts)
    x = activations(5, 96, torch.bfloat16)
    first = layer(x)
    monkeypatch.setattr(BlockQuantLinear, "block_weights", lambda self: pytest.fail("block weights built again"))
    general = linear_module._row_invariant_forward
    monkeypatch.setattr(linear_module, "_row_invariant_forward", lambda *a: pytest.fail("the general path taken"))
    want = torch.cat([kernels.block_panel_linear(x, *p.panels(), p.format, p.out_features, False) for p in parts], 1)
    assert torch.equal(layer(x), want) and torch.equal(first, want)
    monkeypatch.setattr(linear_module, "_row_invariant_forward", general)
    assert torch.equal(layer(x.view(1, 5, 96)), want.view(1, 5, 88))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_repack_without_loss(qtype):
    """Blocks quantized by gguf-py, repacked for the kernel, dequantize to exactly what gguf-py reads from them
    (48 columns: an odd number of blocks per row stays odd)."""
    original = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quantize(original, GGMLQuantizationType[qtype])
    want = dequantize(raw, GGMLQuantizationType[qtype])
    weight = _to_block_weight(qtype, torch.from_numpy(raw).reshape(6, 3, -1), 96)
    assert torch.equal(weight.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_gguf_5_and_6_bit_and_k_quant_blocks_dequantize_as_gguf_py(qtype):
    """Random valid Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks (every code, every sub-block scale), repacked for the
    kernel, dequantize to exactly what gguf-py reads from them; and a slice of whole blocks of 32 keeps them."""
    raw = random_gguf_bytes(qtype, 9, 512, seed=4)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
    block = GGUF_BLOCKS[qtype][0]
    weight = _to_block_weight(qtype, torch.from_numpy(raw).view(9, 512 // block, -1), 512)
    assert weight.format == {"Q5_0": "q5", "Q5_1": "q5", "Q4_K": "q4k", "Q5_K": "q5k", "Q6_K": "q6k"}[qtype]
    assert torch.equal(weight.dequantize(), want)
    assert torch.equal(weight.slice(slice(2, 7), slice(96, 352)).dequantize(), want[2:7, 96:352])
    assert weight.codes().max() >= 2 ** (4 + EXTRA_BITS[weight.format]) - 1  # the high bits are in use


def test_bytes_per_weight_of_the_k_quant_layouts():
    """What the kernel reads per weight (codes and scales; the file: Q4_K 0.5625, Q5_K 0.6875, Q6_K 0.8203,
    Q5_0 0.6875). The K-quants keep the file's scales (float16 per super-block, a byte per sub-block): Q6_K's
    bytes are the file's; Q4_K's and Q5_K's 1/64 more (a byte each for the 6-bit scale and min). With their scales
    expanded to float32 per block they were 0.75, 0.875 and 1.0."""
    def per_weight(qtype: str) -> float:
        panels, scales = random_blocks(qtype, 64, 512).panels()
        return (panels.numel() + scales.numel() * scales.element_size()) / (64 * 512)

    assert {q: per_weight(q) for q in GGUF_BLOCKS} == {"Q5_0": 0.75, "Q5_1": 0.75, "Q4_K": 0.578125,
                                                       "Q5_K": 0.703125, "Q6_K": 210 / 256}


K_QUANT_FORMATS = {"Q4_K": ("q4k", "q4f"), "Q5_K": ("q5k", "q5f"), "Q6_K": ("q6k", "q6f")}


@needs_panels
@pytest.mark.parametrize("qtype", list(K_QUANT_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quant_scales_as_the_file_keeps_them_give_the_float32_scales_bits(qtype, dtype):
    """The kernel forms a K-quant block's scale from the file's float16 d (and -dmin) and byte sub-block scale
    (and min): exact in float32, so every output is bitwise the one of the same weights with float32 scales per
    block (the layout the kernel read before), at every tile remainder of the inline (few rows) and buffered (many
    rows) paths, a short last column tile, both output roundings."""
    weight = random_blocks(qtype, 130, 768, seed=2)
    expanded = weight.with_float32_scales()
    assert (weight.format, expanded.format) == K_QUANT_FORMATS[qtype]
    assert weight.scales.element_size() == 1 and weight.super_scales.dtype == torch.int16
    assert torch.equal(expanded.dequantize(), weight.dequantize())
    compact, float32 = weight.panels(), expanded.panels()
    assert compact[1].dtype == torch.uint8 and float32[1].dtype == torch.float32
    assert compact[1].numel() * 3 < float32[1].numel() * 4  # under a third of the bytes
    for rows in (1, 2, 5, 6, 7, 8, 9, 16, 37):
        x = activations(rows, weight.in_features, dtype, seed=rows)
        for float_output in (False, True):
            got = kernels.block_panel_linear(x, *compact, weight.format, 130, float_output)
            want = kernels.block_panel_linear(x, *float32, expanded.format, 130, float_output)
            assert torch.equal(got, want), (rows, float_output)


@pytest.mark.parametrize("qtype", list(K_QUANT_FORMATS))
def test_k_quant_slices_keep_the_files_scales_on_super_blocks(qtype):
    """A slice on super-block boundaries (256 inputs) keeps the file's scales; one that cuts a super-block holds the
    same weights with float32 scales per block; rows of fused parts concatenate with their super-block scales."""
    weight = random_blocks(qtype, 9, 768, seed=3)
    want = weight.dequantize()
    aligned = weight.slice(slice(2, 7), slice(256, 768))
    assert aligned.format == K_QUANT_FORMATS[qtype][0] and aligned.super_scales.shape[:2] == (5, 2)
    assert torch.equal(aligned.dequantize(), want[2:7, 256:])
    cut = weight.slice(slice(2, 7), slice(96, 352))
    assert cut.format == K_QUANT_FORMATS[qtype][1] and torch.equal(cut.dequantize(), want[2:7, 96:352])
    fused = BlockWeight.concat([weight.slice(slice(0, 4)), weight.slice(slice(4, 9))])
    assert fused.format == weight.format and torch.equal(fused.dequantize(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_kernel_the_dense_fallback_gives_the_same_weights(monkeypatch, dtype):
    """Where the kernel cannot run (CUDA, no compiler), the layer multiplies by the dequantized weights."""
    weight = random_blocks("q4", 64, 96)
    x = activations(4, 96, dtype)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    layer = BlockQuantLinear(weight)
    got = layer(x)
    # Padded as the layer pads for batch invariance (MKL's float32 sums differ by row count: on an Intel CPU here
    # even 4 rows alone and 4 of 16 differ).
    want = padded_matmul(lambda rows: torch.nn.functional.linear(rows, weight.dequantize().to(dtype)), x,
                         layer.min_rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_untied_embedding_in_blocks_gives_the_dequantized_rows(fmt):
    """An 8B's embedding (untied from its head) is kept in its blocks: its rows are the file's weights rounded once
    to the dtype (70 rows: ids in a short last panel too)."""
    from serval.layers.embedding import BlockEmbedding

    weight = random_blocks(fmt, 70, 512)
    embedding = BlockEmbedding.of_blocks(weight, torch.bfloat16)
    ids = torch.tensor([[0, 5], [69, 33]])
    assert torch.equal(embedding(ids), weight.dequantize()[ids].to(torch.bfloat16))


@needs_panels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_features", [512, 80])  # a K the blocks pad
def test_the_kernels_rows_of_the_panels_are_the_dequantized_rows(fmt, in_features):
    """An embedding's lookup by the CPU kernel (csrc/panel_linear.cpp's block_panel_rows) gives each row's weights
    as dequantize does, bit for bit, as does the PyTorch path it replaces: ids in both panels of a tile, in a short
    last panel, repeated, and none."""
    weight = random_blocks(fmt, 70, in_features)
    panels, scales = weight.panels()
    ids = torch.tensor([0, 5, 16, 31, 32, 69, 33, 5])
    want = weight.dequantize()[ids]
    width = weight.in_features  # (the GGUF formats' random blocks fill whole blocks)
    got = linear_module.dequantized_panel_rows(weight.format, panels, scales, ids, width)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    by_torch = BlockWeight.from_panels(weight.format, panels, scales, ids, width).dequantize()
    assert torch.equal(by_torch, want)
    empty = linear_module.dequantized_panel_rows(weight.format, panels, scales, ids[:0], width)
    assert empty.shape == (0, width)
