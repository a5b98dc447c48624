"""The block kernel's bfloat16 dot products (csrc/bf16_dot_linear.cpp, EngineConfig.block_dot_products "bf16"):
bfloat16 activations times the q4, q4k, q6k and q8 codes, exact products summed in float32, the scales once per block
(q6k: per sub-block of 16).
Against float64 on the same weights it errs by float32 rounding only, as the float32 FMA kernel does; a row alone
equals the row in any batch (the in-register path up to 6 rows and the decoded-once path above it run the same
steps); and BlockQuantLinear takes it only where it was chosen (use_dot_products)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_block_quant_linear import activations, random_blocks

from serval.config import EngineConfig
from serval.layers import cpu_kernels
from serval.layers import linear as linear_module
from serval.layers.linear import BlockQuantLinear, use_dot_products

kernels = cpu_kernels.load()
needs_bf16_dot = pytest.mark.skipif(kernels is None or not kernels.block_bf16_dot_kernel_available(),
                                    reason="the bfloat16 dot-product kernel needs the C++ kernels and AVX-512 BF16")
needs_tiles = pytest.mark.skipif(kernels is None or not kernels.bf16_dot_tiles_available(),
                                 reason="the AMX tiles need AMX-BF16 (Intel Sapphire Rapids and later)")


def reference(weight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x W^T in float64 (the file's weights, exact) and the sum of its terms' magnitudes (float32 rounding's scale)."""
    w = weight.dequantize().double()
    return x.double() @ w.T, x.double().abs() @ w.abs().T


@needs_bf16_dot
@pytest.mark.parametrize("fmt", ["q4", "Q4_K", "Q6_K", "q8"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 37])
@pytest.mark.parametrize("shape", [(200, 576), (37, 80)])  # a short last panel; a K the blocks pad
def test_bf16_dot_products_equal_the_weights_product_to_float32_rounding(fmt, rows, shape):
    """Nothing is rounded before the float32 sums: against float64 the error is under 2^-17 of the sum of |terms|
    (q4's biased codes, 128 + q, make a block's partial sums up to 143/15 times the terms', then 32 roundings of
    2^-24 each), the same bound the float32 FMA kernel meets."""
    out_features, in_features = shape
    weight = random_blocks(fmt, out_features, in_features)  # Q4_K: in_features rounded up to its 256
    panels, fmt = weight.panels(), weight.format
    x = activations(rows, weight.in_features, torch.bfloat16)
    want, scale = reference(weight, x)
    y = kernels.block_panel_linear_bf16_dot(x, *panels, fmt, out_features, True)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    assert ((y.double() - want).abs() <= scale * 2.0**-17).all()
    fma = kernels.block_panel_linear(x, *panels, fmt, out_features, True)
    assert ((fma.double() - want).abs() <= scale * 2.0**-17).all()
    # bfloat16 results are the float32 ones rounded to nearest even.
    rounded = kernels.block_panel_linear_bf16_dot(x, *panels, fmt, out_features, False)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, y.bfloat16())


@needs_bf16_dot
@pytest.mark.parametrize("fmt", ["q4", "Q4_K", "Q6_K", "q8"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", ["vectors", "FMAs from 7 rows", "AMX tiles"])
def test_each_row_is_the_same_whatever_the_batch(fmt, threads, path, fma_rows_restored):
    """Rows 0-39 in batches of every size from 1 to 40, on one thread and on two: every row's bits equal its bits
    alone. By vectors: the 6-row tile, its remainders, passes of 6 rows over codes decoded in registers up to 16 or 32
    rows, and the decoded-once path above; with the FMA path from 7 rows, as an Intel Xeon runs it; on AMX tiles: one
    C tile of up to 16 rows (Q6_K: 8, two A rows a row), whole tiles and a remainder after them."""
    weight = random_blocks(fmt, 300, 576, seed=3)
    panels, fmt = weight.panels(), weight.format
    x = activations(40, weight.in_features, torch.bfloat16, seed=4)
    if path == "FMAs from 7 rows" and not kernels.bf16_dot_is_two_fmas():
        pytest.skip("this CPU's vdpbf16ps is not two FMAs in turn: no FMA path")
    if path == "AMX tiles" and not kernels.bf16_dot_tiles_available():
        pytest.skip("the AMX tiles need AMX-BF16 (Intel Sapphire Rapids and later)")
    fma_rows_restored(7 if path == "FMAs from 7 rows" else 0)
    tiles = path == "AMX tiles"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernels.block_panel_linear_bf16_dot(x[i: i + 1], *panels, fmt, 300, True, tiles)
                           for i in range(40)])
        for rows in range(1, 41):
            together = kernels.block_panel_linear_bf16_dot(x[:rows], *panels, fmt, 300, True, tiles)
            assert torch.equal(together, alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


@needs_bf16_dot
def test_bad_calls_are_refused():
    weight = random_blocks("q4", 64, 64)
    panels = weight.panels()
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.block_panel_linear_bf16_dot(torch.ones(2, 64), *panels, "q4", 64, False)
    q5 = random_blocks("Q5_1", 64, 64)
    with pytest.raises(RuntimeError, match="q4, q4k, q6k or q8"):
        kernels.block_panel_linear_bf16_dot(torch.ones(2, 64, dtype=torch.bfloat16), *q5.panels(), q5.format, 64,
                                            False)


@needs_bf16_dot
def test_the_linear_takes_the_kernel_it_is_set_to():
    """use_dot_products sets every q4/q4k/q6k/q8 block linear; "bf16" gives the dot-product kernel's bits for bfloat16
    rows (float32 rows stay on the FMA kernel: their rounding to bfloat16 would change the numerics), "fma" the FMA
    kernel's; "auto" resolves to one of them; other names are refused."""
    weight = random_blocks("q4", 96, 576, seed=5)
    model = torch.nn.Sequential(BlockQuantLinear(weight))
    layer = model[0]
    x = activations(3, 576, torch.bfloat16, seed=6)
    panels = weight.panels()
    layer(x)  # builds the panels
    assert use_dot_products(model, "bf16") == "bf16" and layer.dot_products == "bf16"
    assert torch.equal(layer(x), kernels.block_panel_linear_bf16_dot(x, *panels, "q4", 96, False))
    assert torch.equal(layer(x.float()), kernels.block_panel_linear(x.float(), *panels, "q4", 96, False))
    assert use_dot_products(model, "fma") == "fma" and layer.dot_products == "fma"
    assert torch.equal(layer(x), kernels.block_panel_linear(x, *panels, "q4", 96, False))
    assert not torch.equal(kernels.block_panel_linear_bf16_dot(x, *panels, "q4", 96, True),
                           kernels.block_panel_linear(x, *panels, "q4", 96, True))  # two kernels, told apart
    assert use_dot_products(model, "auto") in ("fma", "bf16", "amx")
    # A fused linear of a q4 and a Q5_1 part: the q4 part on the dot products, the other on the FMA kernel.
    q5 = random_blocks("Q5_1", 40, 576, seed=7)
    fused = torch.nn.Sequential(BlockQuantLinear([weight, q5]))
    fused(x)
    use_dot_products(fused, "bf16")
    want = torch.cat([kernels.block_panel_linear_bf16_dot(x, *panels, "q4", 96, False),
                      kernels.block_panel_linear(x, *q5.panels(), q5.format, 40, False)], dim=-1)
    assert torch.equal(fused(x), want)
    with pytest.raises(ValueError, match="block_dot_products"):
        use_dot_products(model, "int4")
    with pytest.raises(ValueError, match="--block-dot-products"):
        EngineConfig(block_dot_products="int4")


@needs_bf16_dot
def test_auto_follows_the_measurement(monkeypatch):
    """"auto" is "bf16" exactly where the measurement found it faster (by DOT_PRODUCT_MARGIN at 1 and 16 rows), and
    "amx" where the tiles beat that choice; the tiles are timed where this CPU has them. A CPU without AMX tiles (an
    AMD EPYC Zen 4) that were reported faster still gets "bf16", never a kernel it cannot run."""
    model = torch.nn.Sequential(BlockQuantLinear(random_blocks("q8", 32, 64)))
    tiles_choice = "amx" if kernels.bf16_dot_tiles_available() else "bf16"
    for faster, tiles, choice in ((True, False, "bf16"), (False, False, "fma"), (True, True, tiles_choice)):
        monkeypatch.setattr(linear_module, "bf16_dot_products_faster", lambda faster=faster: faster)
        monkeypatch.setattr(linear_module, "amx_tiles_faster", lambda other, tiles=tiles: tiles)
        assert use_dot_products(model, "auto") == choice and model[0].dot_products == choice
    monkeypatch.undo()
    threads = torch.get_num_threads()
    measured = linear_module._measure_dot_products(kernels)
    assert measured.pop("method") == linear_module.DOT_PRODUCT_METHOD and torch.get_num_threads() == threads
    fma_path = {"bf16_fmas_16"} if kernels.bf16_dot_is_two_fmas() else set()
    tiles = {"amx_1", "amx_16"} if kernels.bf16_dot_tiles_available() else set()
    int8 = {"int8_1", "int8_16"} if kernels.block_int8_kernel_available() else set()
    assert set(measured) == {"fma_1", "bf16_1", "fma_16", "bf16_16"} | fma_path | tiles | int8
    assert all(v > 0 for v in measured.values())


@needs_bf16_dot
def test_a_record_of_another_method_is_measured_again(monkeypatch, tmp_path):
    """The choice is kept beside the build; a record written by an earlier way of measuring (two threads, which a
    loaded machine made 75x slow) is measured again, and the new record kept."""
    record = tmp_path / "kernels.dot_products.json"
    record.write_text(json.dumps({"fma_1": 3970.0, "bf16_1": 3110.0, "fma_16": 3416.0, "bf16_16": 3978.0}))
    monkeypatch.setattr(linear_module, "_dot_product_measurement", {})
    monkeypatch.setattr(linear_module, "_panel_kernels", lambda device: SimpleNamespace(
        __file__=str(tmp_path / "kernels.so")))
    fresh = {"fma_1": 60.0, "bf16_1": 30.0, "fma_16": 300.0, "bf16_16": 150.0,
             "method": linear_module.DOT_PRODUCT_METHOD}
    monkeypatch.setattr(linear_module, "_measure_dot_products", lambda kernels: dict(fresh))
    assert linear_module.bf16_dot_products_faster() is True
    assert json.loads(record.read_text()) == fresh


def recorded_measurement(monkeypatch, tmp_path, measured: dict) -> None:
    """Makes ``measured`` the record kept beside the build, as this build's method wrote it."""
    record = tmp_path / "kernels.dot_products.json"
    record.write_text(json.dumps({**measured, "method": linear_module.DOT_PRODUCT_METHOD}))
    monkeypatch.setattr(linear_module, "_dot_product_measurement", {})
    monkeypatch.setattr(linear_module, "_panel_kernels", lambda device: SimpleNamespace(
        __file__=str(tmp_path / "kernels.so")))


@pytest.mark.parametrize(("measured", "faster", "fma_rows"), [
    # an AMD Zen 4 (2026-11-27): faster at both
    ({"fma_1": 114.0, "bf16_1": 63.0, "fma_16": 688.0, "bf16_16": 419.0}, True, 0),
    # an Intel Xeon (2026-11-30) without the FMA path: 1.5x faster at one row, 1.47x slower at 16
    ({"fma_1": 130.0, "bf16_1": 87.0, "fma_16": 605.0, "bf16_16": 892.0}, False, 0),
    # ... and with it: 1.09x faster at 16 rows by the FMA path, from 7 rows
    ({"fma_1": 182.0, "bf16_1": 117.0, "fma_16": 1052.0, "bf16_16": 1500.0, "bf16_fmas_16": 966.0}, True, 7),
    # the FMA path 1.08x slower at 16 rows: within the margin
    ({"fma_1": 182.0, "bf16_1": 117.0, "fma_16": 1000.0, "bf16_16": 1500.0, "bf16_fmas_16": 1080.0}, True, 7),
    # ... 1.15x slower: not
    ({"fma_1": 182.0, "bf16_1": 117.0, "fma_16": 1000.0, "bf16_16": 1500.0, "bf16_fmas_16": 1150.0}, False, 7),
    # faster at 16 rows but only 1.05x at one
    ({"fma_1": 105.0, "bf16_1": 100.0, "fma_16": 688.0, "bf16_16": 419.0}, False, 0),
    # a CPU where the FMA path makes bf16 faster at both
    ({"fma_1": 130.0, "bf16_1": 87.0, "fma_16": 605.0, "bf16_16": 892.0, "bf16_fmas_16": 500.0}, True, 7),
    # the FMA path slower than the dot products: not taken
    ({"fma_1": 114.0, "bf16_1": 63.0, "fma_16": 688.0, "bf16_16": 419.0, "bf16_fmas_16": 500.0}, True, 0),
])
def test_the_choice_needs_one_row_faster_and_sixteen_not_slower(monkeypatch, tmp_path, measured, faster, fma_rows):
    """bf16 where it is 1.1x faster at one row and at most 1.1x slower at 16 rows, there by its faster path; its FMA
    path from 7 rows where that path was timed (it has the dot products' bits on this CPU) and was the faster."""
    recorded_measurement(monkeypatch, tmp_path, measured)
    assert linear_module.bf16_dot_products_faster() is faster
    assert linear_module.dot_product_measurement()["bf16_fma_rows"] == fma_rows


@pytest.mark.parametrize(("measured", "tiles"), [
    # an Intel Xeon, Emerald Rapids (2026-11-30): as fast at one row, 4x at 16
    ({"fma_1": 164.0, "bf16_1": 108.0, "amx_1": 101.0, "fma_16": 909.0, "bf16_16": 984.0, "bf16_fmas_16": 919.0,
      "amx_16": 228.0}, True),
    # 1.08x slower at one row: within the margin
    ({"fma_1": 164.0, "bf16_1": 100.0, "amx_1": 108.0, "fma_16": 909.0, "bf16_16": 984.0, "amx_16": 228.0}, True),
    # 1.14x slower at one row (a start of 2026-11-30 that took the dot products): within the one-row slack
    ({"fma_1": 191.7, "bf16_1": 124.4, "amx_1": 139.3, "fma_16": 919.8, "bf16_16": 1154.4, "bf16_fmas_16": 876.3,
      "amx_16": 243.6}, True),
    # 1.3x slower at one row: not
    ({"fma_1": 164.0, "bf16_1": 100.0, "amx_1": 130.0, "fma_16": 909.0, "bf16_16": 984.0, "amx_16": 228.0}, False),
    # only 1.05x faster at 16 rows than the FMA path: not
    ({"fma_1": 164.0, "bf16_1": 108.0, "amx_1": 101.0, "fma_16": 909.0, "bf16_16": 984.0, "bf16_fmas_16": 240.0,
      "amx_16": 228.0}, False),
    # against the FMAs where the dot products lost to them: their one-row time is the bar
    ({"fma_1": 105.0, "bf16_1": 100.0, "amx_1": 112.0, "fma_16": 900.0, "bf16_16": 1500.0, "amx_16": 228.0}, True),
    # no tiles timed (a CPU without them)
    ({"fma_1": 164.0, "bf16_1": 108.0, "fma_16": 909.0, "bf16_16": 984.0}, False),
])
def test_the_tiles_need_sixteen_rows_faster_and_one_not_much_slower(monkeypatch, tmp_path, measured, tiles):
    """"auto" takes the tiles over its other choice where they were 1.1x faster at 16 rows and at most 1.25x slower
    at one row (AMX_ONE_ROW_SLACK)."""
    recorded_measurement(monkeypatch, tmp_path, measured)
    other = "bf16" if linear_module.bf16_dot_products_faster() else "fma"
    assert linear_module.amx_tiles_faster(other) is tiles
    assert linear_module.auto_dot_products() == ("amx" if tiles else other)


@pytest.fixture
def fma_rows_restored():
    yield kernels.set_bf16_dot_fma_rows
    kernels.set_bf16_dot_fma_rows(0)


needs_fma_path = pytest.mark.skipif(kernels is None or not kernels.bf16_dot_is_two_fmas(),
                                    reason="this CPU's vdpbf16ps is not two FMAs in turn (or no kernel)")


@needs_fma_path
@pytest.mark.parametrize("fmt", ["q4", "Q4_K", "Q6_K", "q8"])
@pytest.mark.parametrize("shape", [(200, 576), (37, 80), (1000, 512), (48, 8192)])
def test_the_fma_path_has_the_dot_products_bits(fmt, shape, fma_rows_restored):
    """The FMA path (many rows on an Intel Xeon) gives vdpbf16ps's bits: every row count, every format, a short last
    panel, a K the blocks pad, and activations spanning 2^-100 to 2^100 with some below (flushed to 0 on both
    paths) and some zeros."""
    out_features, in_features = shape
    weight = random_blocks(fmt, out_features, in_features, seed=7)
    panels, fmt = weight.panels(), weight.format
    generator = torch.Generator().manual_seed(8)
    x = activations(40, weight.in_features, torch.float32, seed=9)
    x = x * torch.exp2(torch.randint(-110, 100, x.shape, generator=generator).float())
    x[torch.rand(x.shape, generator=generator) < 0.05] = 0
    x = x.bfloat16()
    for rows in (1, 6, 7, 13, 40):
        fma_rows_restored(0)
        by_dot_products = kernels.block_panel_linear_bf16_dot(x[:rows], *panels, fmt, out_features, True)
        fma_rows_restored(1)
        assert torch.equal(kernels.block_panel_linear_bf16_dot(x[:rows], *panels, fmt, out_features, True),
                           by_dot_products), rows


@needs_bf16_dot
def test_the_fma_path_is_refused_where_its_bits_would_differ(fma_rows_restored):
    with pytest.raises(RuntimeError, match=">= 0"):
        fma_rows_restored(-1)
    if kernels.bf16_dot_is_two_fmas():
        fma_rows_restored(7)
    else:
        with pytest.raises(RuntimeError, match="not two FMAs"):
            fma_rows_restored(7)



@needs_tiles
@pytest.mark.parametrize("fmt", ["q4", "Q4_K", "Q6_K", "q8"])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 37])
@pytest.mark.parametrize("shape", [(200, 576), (37, 80)])  # a short last panel; a K the blocks pad
def test_the_tiles_equal_the_weights_product_to_float32_rounding(fmt, rows, shape):
    """On AMX tiles the dot products err against float64 within the vector kernel's bound (2^-17 of the sum of
    |terms|), with their own rounding (their bits differ from vdpbf16ps's); bfloat16 results are theirs rounded."""
    out_features, in_features = shape
    weight = random_blocks(fmt, out_features, in_features, seed=11)
    panels, fmt = weight.panels(), weight.format
    x = activations(rows, weight.in_features, torch.bfloat16, seed=12)
    want, scale = reference(weight, x)
    y = kernels.block_panel_linear_bf16_dot(x, *panels, fmt, out_features, True, tiles=True)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    assert ((y.double() - want).abs() <= scale * 2.0**-17).all()
    rounded = kernels.block_panel_linear_bf16_dot(x, *panels, fmt, out_features, False, tiles=True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, y.bfloat16())
    vector = kernels.block_panel_linear_bf16_dot(x, *panels, fmt, out_features, True)
    assert ((vector.double() - want).abs() <= scale * 2.0**-17).all()


@needs_bf16_dot
def test_amx_sets_the_tiles_for_the_dot_product_linears():
    """use_dot_products "amx" runs the block linears' dot products on the tiles where the CPU has them (else it
    says so and takes "bf16"); any other choice turns them off again. The choice is each linear's: another model's
    linears keep theirs."""
    weight = random_blocks("Q4_K", 96, 576, seed=5)
    model = torch.nn.Sequential(BlockQuantLinear(weight))
    layer = model[0]
    x = activations(3, weight.in_features, torch.bfloat16, seed=6)
    panels = weight.panels()
    layer(x)
    if not kernels.bf16_dot_tiles_available():
        assert use_dot_products(model, "amx") == "bf16"
        with pytest.raises(RuntimeError, match="no AMX-BF16"):
            kernels.block_panel_linear_bf16_dot(x, *panels, "q4k", 96, False, tiles=True)
        return
    other = torch.nn.Sequential(BlockQuantLinear(weight))
    other[0](x)
    assert use_dot_products(other, "bf16") == "bf16"
    assert use_dot_products(model, "amx") == "amx" and layer.dot_products == "amx"
    on_tiles = layer(x)
    assert torch.equal(on_tiles, kernels.block_panel_linear_bf16_dot(x, *panels, "q4k", 96, False, tiles=True))
    by_vectors = kernels.block_panel_linear_bf16_dot(x, *panels, "q4k", 96, False)
    assert not torch.equal(kernels.block_panel_linear_bf16_dot(x, *panels, "q4k", 96, True, tiles=True),
                           kernels.block_panel_linear_bf16_dot(x, *panels, "q4k", 96, True))  # two paths, told apart
    assert torch.equal(other[0](x), by_vectors)
    assert use_dot_products(model, "bf16") == "bf16"
    assert torch.equal(layer(x), by_vectors)
