"""The load's block re-layouts in the CPU kernels (csrc/block_repack.cpp) write the very bytes of their PyTorch
references: a GGUF file's K-quant blocks as BlockWeight's blocks, and every format's blocks as the kernel's panels
(whole weights, rows that do not fill a panel, slices, parts written into a larger tensor)."""

from __future__ import annotations

import pytest
import torch
from test_block_quant_linear import random_blocks, random_gguf_bytes

from serval.layers import cpu_kernels
from serval.layers.linear import BlockWeight
from serval.model.gguf_file import _k_block_weight_by_torch, _to_block_weight

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels are not built here")


def gguf_blocks(qtype: str, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    block = 256 if qtype.endswith("_K") else 32
    raw = torch.from_numpy(random_gguf_bytes(qtype, rows, in_features, seed))
    return raw.view(rows, in_features // block, -1)


def same_bytes(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(
        got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_blocks_are_the_torch_paths_bytes(qtype):
    raw = gguf_blocks(qtype, 70, 768)
    got, want = _to_block_weight(qtype, raw, 768), _k_block_weight_by_torch(qtype, raw, 768)
    assert (got.format, got.in_features) == (want.format, want.in_features)
    for name in ("packed", "scales", "super_scales"):
        assert same_bytes(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.dequantize(), want.dequantize())


def weights_of_every_format() -> dict[str, BlockWeight]:
    weights = {"q4": random_blocks("q4", 70, 96), "q8": random_blocks("q8", 70, 96)}
    for qtype in ("Q5_0", "Q5_1"):
        weights[qtype] = _to_block_weight(qtype, gguf_blocks(qtype, 70, 96), 96)
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        weight = _to_block_weight(qtype, gguf_blocks(qtype, 70, 512), 512)
        weights[qtype] = weight
        weights[f"{qtype} float32 scales"] = weight.with_float32_scales()  # q4f, q5f, q6f
        weights[f"{qtype} rows and columns cut"] = weight.slice(slice(3, 60), slice(256, 512))  # strided views
    weights["Q4_0 columns cut"] = _to_block_weight("Q4_0", gguf_blocks("Q5_0", 70, 128)[..., :18], 128).slice(
        columns=slice(32, 96))  # (Q5_0's bytes, cut to Q4_0's size: any bytes are codes)
    return weights


@pytest.mark.parametrize("name", list(weights_of_every_format()))
def test_the_panels_are_the_torch_paths_bytes(name):
    weight = weights_of_every_format()[name]
    got, want = weight.panels(), weight.panels_by_torch()
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_1"])
def test_parts_written_into_one_tensor_are_the_torch_paths_bytes(qtype):
    block = 256 if qtype.endswith("_K") else 32
    parts = [_to_block_weight(qtype, gguf_blocks(qtype, rows, 2 * block, seed), 2 * block)
             for seed, rows in enumerate((64, 32, 40))]
    got = BlockWeight.panels_of(parts)
    q, scales = parts[0]._empty_panels(got[0].shape[0])
    q.fill_(7)  # (anything left unwritten would show)
    start = 0
    for part in parts:
        count = -(-part.out_features // 32) * 2
        part.panels_by_torch((q[start: start + count], scales[start: start + count]))
        start += count
    assert same_bytes(got[0], q) and same_bytes(got[1], scales)


def test_the_panels_of_a_real_files_matrix_are_the_torch_paths_bytes():
    """Llama's q/k rows come back from llama.cpp's RoPE order as a copy; the rest are views of the file's blocks."""
    from serval.model.gguf_file import GGUFModelFile
    from serval.model.registry import resolve_model_path

    gguf = GGUFModelFile(resolve_model_path(None))
    seen = 0
    for name, weight in gguf.block_weights(gguf.model_config()):
        if name.endswith(("layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight")):
            got, want = weight.panels(), weight.panels_by_torch()
            assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
            seen += 1
    assert seen == 2


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("reordered", [False, True])
def test_k_quant_panels_straight_from_the_file_are_the_two_passes_bytes(qtype, reordered):
    """A load's K-quant matrix (gguf_file.py's FileKBlocks) writes its panels from the file's super-blocks in one
    pass (gguf_k_panels_): the bytes of the blocks of 32 (gguf_k_blocks) laid out as panels (block_panels_), rows
    reordered as Llama's q/k are (llama.cpp's RoPE order undone), alone or as a part of a fused matrix; its blocks,
    when something reads them, are the two-pass path's too."""
    from serval.model.gguf_file import FileKBlocks, _unpermute_rope

    view = random_gguf_bytes(qtype, 70, 512)
    order = _unpermute_rope(torch.arange(70)[:, None], 5)[:, 0] if reordered else None
    blocks = _to_block_weight(qtype, gguf_blocks(qtype, 70, 512), 512)
    if reordered:
        blocks = BlockWeight(blocks.format, blocks.packed[order], blocks.scales[order], 512,
                             blocks.super_scales[order])
    got, want = FileKBlocks(qtype, view, 512, order).panels(), blocks.panels()
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    # the last of three parts of a fused matrix, written into its rows of the fused panels
    other = _to_block_weight(qtype, gguf_blocks(qtype, 64, 512, seed=3), 512)
    fused = BlockWeight.panels_of([other, other, FileKBlocks(qtype, view, 512, order)])
    assert same_bytes(fused[0], BlockWeight.panels_of([other, other, blocks])[0])
    assert same_bytes(fused[1], BlockWeight.panels_of([other, other, blocks])[1])
    lazy = FileKBlocks(qtype, view, 512, order)
    assert (lazy.format, lazy.in_features, lazy.out_features) == (blocks.format, 512, 70)
    for name in ("packed", "scales", "super_scales"):
        assert same_bytes(getattr(lazy, name), getattr(blocks, name)), name
    cut, want_cut = FileKBlocks(qtype, view, 512, order).slice(slice(3, 60), slice(256, 512)), blocks.slice(
        slice(3, 60), slice(256, 512))  # a tensor-parallel rank's slice
    assert same_bytes(cut.panels()[0], want_cut.panels()[0]) and same_bytes(cut.panels()[1], want_cut.panels()[1])
