"""Linear layers without bias. A module of its own so quantized forms can replace it.

Batch invariance: a row's result must not depend on how many rows share the call, or greedy output would
change with batch composition. CPU GEMM libraries pick a kernel by row count (a matrix-vector path for one
row, other blockings for a few), and some of those sum in another order: measured here, float32 (MKL) gives
three different results for a row at 1, 2-3 and 4+ rows, and bfloat16 (oneDNN) differs at 1-2 rows once the
reduction is longer than 1024. So each weight shape is probed once on the CPU it runs on, and calls are padded
to the smallest row count from which every row's result is the same. Where the C++ kernels run, dense weights do
not pay this: ``lay_out_for_cpu_kernels`` stores them transposed for ``csrc/panel_linear.cpp``, which computes each
row alone (min_rows 1), as it does for the GGUF blocks.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from serval.config import ACTIVATION_QUANTIZATION_CHOICES, BLOCK_DOT_PRODUCT_CHOICES
from serval.layers import cpu_kernels
from serval.layers.host_memory import empty_in_huge_pages

logger = logging.getLogger(__name__)

_ROW_PADDINGS = (1, 4, 16, 64)  # tried in order; the first that makes results row-invariant is used
_PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64)
_row_padding_by_shape: dict[tuple, int] = {}


def row_padding(matmul: Callable[[torch.Tensor], torch.Tensor], in_features: int, key: tuple,
                dtype: torch.dtype, device: torch.device) -> int:
    """The smallest row count to pad ``matmul``'s input to so that each row's output is bitwise the same
    whatever the number of rows; probed once per ``key`` (the weight's shape and kind)."""
    key = (*key, dtype, device.type)
    if key not in _row_padding_by_shape:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(max(_PROBE_ROWS), in_features, generator=generator, device=device).to(dtype)
        for padding in _ROW_PADDINGS:
            if _rows_are_invariant(matmul, x, padding):
                break
        else:
            logger.warning("no row padding makes %s linears row-invariant on this device: greedy output may "
                           "depend on batch composition", key)
            padding = 1
        _row_padding_by_shape[key] = padding
    return _row_padding_by_shape[key]


def _rows_are_invariant(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, padding: int) -> bool:
    # A flip shows only where the two sums round differently, so every row is checked alone as well.
    full = padded_matmul(matmul, x, padding)
    if any(not torch.equal(padded_matmul(matmul, x[:m], padding), full[:m]) for m in _PROBE_ROWS):
        return False
    return all(torch.equal(padded_matmul(matmul, x[i: i + 1], padding), full[i: i + 1]) for i in range(len(x)))


def padded_matmul(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """``matmul(x)`` with x [M, in] padded with zero rows up to ``rows``."""
    m = x.shape[0]
    if m >= rows:
        return matmul(x)
    return matmul(F.pad(x, (0, 0, 0, rows - m)))[:m]


DENSE_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def dense_kernels(weight: torch.Tensor):
    """The CPU kernels if ``weight`` [out, in] is laid out for their dense linear (its transpose W^T [in, out]
    contiguous: ``lay_out_for_cpu_kernels``) and they run here; else None."""
    if weight.dtype not in DENSE_KERNEL_DTYPES or not weight.t().is_contiguous():
        return None
    return _panel_kernels(weight.device)


def _panel_kernels(device: torch.device):
    kernels = cpu_kernels.for_device(device)
    return kernels if kernels is not None and kernels.block_panel_kernel_available() else None


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] times ``weight`` [out, in] transposed: the CPU kernel where the weight is laid out for it (each
    row's result independent of the others: csrc/panel_linear.cpp), else F.linear."""
    kernels = dense_kernels(weight)
    if kernels is not None:
        return kernels.dense_panel_linear(x, weight.t(), False)
    return F.linear(x, weight)


def _row_invariant_forward(layer: Linear | Int8Linear | BlockQuantLinear, x: torch.Tensor, key: tuple) -> torch.Tensor:
    """``layer._matmul`` over x [..., in] flattened to rows, padded to the layer's probed row count."""
    flat = x.reshape(-1, layer.in_features)
    if layer.min_rows is None:
        layer.min_rows = row_padding(layer._matmul, layer.in_features, key, flat.dtype, flat.device)
    return padded_matmul(layer._matmul, flat, layer.min_rows).view(*x.shape[:-1], layer.out_features)


class Linear(nn.Module):
    """y = x W^T, W stored [out_features, in_features] in the model dtype (in memory as W^T [in, out] once laid out
    for the CPU kernel: ``lay_out_for_cpu_kernels``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.min_rows: int | None = None  # row padding for batch invariance, probed on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.min_rows is None and dense_kernels(self.weight) is not None:
            # Each row alone (tests/layers/test_linear.py::test_the_dense_kernel_needs_no_row_padding).
            self.min_rows = 1
        return _row_invariant_forward(self, x, ("dense", *self.weight.shape))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight)


class Int8Linear(nn.Module):
    """Weight-only int8: one scale per output row, activations stay in the model dtype.

    Half the bytes of bf16 to read per step, which is what a memory-bound decode pays for."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-10) / 127
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(weight.dtype))
        self.min_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _row_invariant_forward(self, x, ("int8", *self.weight_int8.shape))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return F.linear(x, self.weight_int8.to(x.dtype)) * self.scales  # no fused kernel there: dequantize


BLOCK_SIZE = 32  # weights per block, along the input dimension
SUPER_BLOCK = 256  # weights per K-quant super-block (Q4_K, Q5_K, Q6_K): one float16 d (and dmin) per column
# Bits of each code above its nibble, per BlockWeight.format (q8's codes are whole signed bytes).
EXTRA_BITS = {"q4": 0, "q5": 1, "q4f": 0, "q5f": 1, "q6f": 2, "q4k": 0, "q5k": 1, "q6k": 2}
FLOAT32_SCALES = ("q4f", "q5f", "q6f")
# The K-quant layouts (the file's scales: float16 per super-block, a byte per sub-block) → the same weights with
# their scales expanded to float32 per block (the layout of a slice that cuts super-blocks).
K_FORMATS = {"q4k": "q4f", "q5k": "q5f", "q6k": "q6f"}


@dataclass
class BlockWeight:
    """A weight [out_features, in_features] in blocks of 32 along the input dimension, as GGUF stores it.

    ``format`` "q8": packed [N, G, 32] signed bytes q, scales [N, G, 1] float16 d, w = d * q (Q8_0).
    The others hold unsigned codes q of 4 to 6 bits: packed [N, G, 16 + 4 e] where byte i of the first 16 holds
    code i in the low nibble and code i + 16 in the high one, and the 4 e bytes after them the e bits above the
    nibbles (code i's at bit e i of them, little-endian), e = EXTRA_BITS[format].
    "q4" (Q4_0, Q4_1), "q5" (Q5_0, Q5_1): scales [N, G, 2] float16 (d, m), w = d * q + m.
    "q4k" (Q4_K), "q5k" (Q5_K): the file's scales. super_scales [N, G / 8, 2] float16 (d, -dmin) per super-block
    of 256 weights, scales [N, G, 2] uint8 (the 6-bit sub-block scale sc and min mn); w = (d sc) q + (-dmin mn).
    "q6k" (Q6_K): super_scales [N, G / 8, 1] float16 d, scales [N, G, 2] int8: sc of codes 0-15 and of 16-31;
    w = (d sc) (q - 32). Each product of a float16 and a 6- or 8-bit integer is exact in float32.
    "q4f", "q5f", "q6f": those weights with the products d sc (and -dmin mn) stored as float32 scales [N, G, 2]
    (a slice that cuts super-blocks; Q5_0 as "q5f" where its -16 d overflows float16)."""

    format: str
    packed: torch.Tensor  # uint8
    # float16 (int16) or float32 (int32) bit patterns, so that casting a model to a dtype leaves them alone; the
    # K formats' sub-block scales as uint8 (int8 for q6k)
    scales: torch.Tensor
    in_features: int
    super_scales: torch.Tensor | None = None  # K formats: float16 bit patterns (int16) [N, G / 8, 2 or 1]
    # the codes ``from_codes`` packed, kept for ``codes()`` (a file's blocks are read once, into panels, at load)
    known_codes: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def block_shape(self) -> tuple[int, int]:
        """(blocks a row, bytes a block of codes): what parts fused into one matrix must share."""
        return tuple(self.packed.shape[1:])

    @staticmethod
    def from_codes(format: str, codes: torch.Tensor, scales: torch.Tensor, in_features: int,
                   super_scales: torch.Tensor | None = None) -> BlockWeight:
        """The weight with codes [N, G, 32] (uint8, below 2^(4 + e)) and scales [N, G, k] (float16 or float32
        values, or the K formats' bytes with their float16 super_scales) packed as ``format`` lays them out."""
        e = EXTRA_BITS[format]
        nibbles = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
        if e:
            high = (codes >> 4).view(*codes.shape[:2], 4 * e, 8 // e)
            shifts = torch.arange(0, 8, e, dtype=torch.uint8)
            nibbles = torch.cat([nibbles, (high << shifts).sum(-1, dtype=torch.uint8)], dim=-1)
        if format in K_FORMATS:
            return BlockWeight(format, nibbles.contiguous(), scales.contiguous(), in_features,
                               super_scales.contiguous().view(torch.int16), known_codes=codes)
        bits = torch.int32 if format in FLOAT32_SCALES else torch.int16
        return BlockWeight(format, nibbles.contiguous(), scales.contiguous().view(bits), in_features,
                           known_codes=codes)

    def codes(self) -> torch.Tensor:
        """Each weight's code, [N, G, 32]: uint8, or int8 for q8."""
        if self.known_codes is not None:
            return self.known_codes
        if self.format == "q8":
            return self.packed.view(torch.int8)
        q = torch.cat([self.packed[..., :16] & 15, self.packed[..., :16] >> 4], dim=-1)
        e = EXTRA_BITS[self.format]
        if e:  # byte b's bits e i and up: code b (8 / e) + i's
            shifts = torch.arange(0, 8, e, dtype=torch.uint8)
            high = (self.packed[..., 16:, None] >> shifts) & ((1 << e) - 1)
            q |= high.view(q.shape) << 4
        return q

    def scale_values(self) -> torch.Tensor:
        """The scales as float32, [N, G, 1 or 2] (the K formats': d sc and -dmin mn, exact)."""
        if self.format in K_FORMATS:
            per_block = self.super_scales.view(torch.float16).float().repeat_interleave(SUPER_BLOCK // BLOCK_SIZE, 1)
            return per_block * self.scales.float()  # q6k: d of both halves; q4k, q5k: d and -dmin
        return self.scales.view(torch.float32 if self.format in FLOAT32_SCALES else torch.float16).float()

    def with_float32_scales(self) -> BlockWeight:
        """The same weights with a K format's scales expanded to float32 per block (other formats: unchanged)."""
        if self.format not in K_FORMATS:
            return self
        return BlockWeight(K_FORMATS[self.format], self.packed, self.scale_values().view(torch.int32),
                           self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 [N, in_features], exactly as the file defines them."""
        scales, q = self.scale_values(), self.codes().float()
        if self.format == "q8":
            w = q * scales
        elif self.format in ("q6f", "q6k"):  # one product: rounded once, as the kernel's fma(q, d, -32 d)
            w = (q - 32) * scales.repeat_interleave(16, dim=-1)
        else:  # q * d is exact (at most 5 + 17 bits): rounded once, as the kernel's fma
            w = q * scales[..., :1] + scales[..., 1:]
        return w.reshape(self.out_features, -1)[:, : self.in_features]

    def panels(self, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same blocks laid out for ``block_panel_linear``: 16 output columns side by side per input position
        (rows padded with zero weights to a multiple of 32). Returns (panels uint8 [P, G, rows, 16], scales float16
        or float32 [P, G, 2 or 1, 16], or for the K formats uint8 [P, G / 8, bytes]: per super-block of a panel its
        16 columns' float16 d (and -dmin), then per block their 16 sub-block scales (and 16 mins)); see
        csrc/panel_linear.cpp. Written into ``into`` (tensors of those shapes, or rows of larger ones) when given.
        By the CPU kernels' one pass (csrc/block_repack.cpp) where they are built, else ``panels_by_torch``."""
        p = -(-self.packed.shape[0] // 32) * 2
        q, scales = self._empty_panels(p) if into is None else into
        kernels = cpu_kernels.for_device(self.packed.device)
        tensors = [t for t in (self.packed, self.scales, self.super_scales) if t is not None]
        if kernels is None or not all(t.stride(-1) == 1 for t in tensors):
            return self.panels_by_torch((q, scales))
        kernels.block_panels_(self.packed, self.scales, self.super_scales, self.format, q, scales)
        return q, scales

    def panels_by_torch(self, into: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``panels()`` by PyTorch ops: where the CPU kernels are not built, and the reference they are tested
        against (tests/layers/test_block_repack.py)."""
        n, groups = self.packed.shape[:2]
        p = -(-n // 32) * 2
        rows = self.packed  # per row and block: the bytes of one column of a panel, in the panel's order
        if self.format != "q8":  # input positions 2i and 2i + 1 share a byte: low and high nibble
            q = self.codes()
            rows = (q[..., 0::2] & 15) | ((q[..., 1::2] & 15) << 4)
            e = EXTRA_BITS[self.format]
            if e:  # byte 16 + k // (8 / e): position k's high bits at bit e (k % (8 / e))
                high = (q >> 4).view(n, groups, 4 * e, 8 // e)
                shifts = torch.arange(0, 8, e, dtype=torch.uint8)
                rows = torch.cat([rows, (high << shifts).sum(-1, dtype=torch.uint8)], dim=-1)

        def side_by_side(t: torch.Tensor) -> torch.Tensor:  # [N, G, k] → a view [P, G, k, 16]
            if p * 16 != n:
                t = F.pad(t, (0, 0, 0, 0, 0, p * 16 - n))
            return t.reshape(p, 16, t.shape[1], -1).permute(0, 2, 3, 1)

        q, scales = self._empty_panels(p) if into is None else into
        _copy_into(q, side_by_side(rows))
        if self.format in K_FORMATS:
            supers = groups // (SUPER_BLOCK // BLOCK_SIZE)
            head = self.super_scales.shape[-1] * 32
            _copy_into(scales[..., :head].view(torch.int16).unflatten(-1, (-1, 16)), side_by_side(self.super_scales))
            _copy_into(scales[..., head:].unflatten(-1, (8, 2, 16)),
                       side_by_side(self.scales.view(torch.uint8)).unflatten(1, (supers, 8)))
        else:
            _copy_into(scales.view(same_width_int(scales.dtype)), side_by_side(self.scales))
        return q, scales

    def _empty_panels(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized (panels, scales) of ``count`` panels of this weight's format and width, in huge pages (each
        decode step streams them)."""
        groups = self.packed.shape[1]
        if self.format in K_FORMATS:
            supers = groups // (SUPER_BLOCK // BLOCK_SIZE)
            scales = empty_in_huge_pages((count, supers, self.super_scales.shape[-1] * 32 + 256), torch.uint8)
        else:
            floats = torch.float32 if self.format in FLOAT32_SCALES else torch.float16
            scales = empty_in_huge_pages((count, groups, self.scales.shape[-1], 16), floats)
        return empty_in_huge_pages((count, groups, self.packed.shape[-1], 16), torch.uint8), scales

    @staticmethod
    def panels_of(parts: list[BlockWeight]) -> tuple[torch.Tensor, torch.Tensor]:
        """The panels of ``parts`` (one format) stacked by rows, as ``BlockWeight.concat(parts).panels()`` gives them,
        each part's written in place where each but the last fills whole panels (no stacked copy of the blocks)."""
        if any(part.out_features % 32 for part in parts[:-1]):
            return BlockWeight.concat(parts).panels()
        if len(parts) == 1:
            return parts[0].panels()
        counts = [-(-part.out_features // 32) * 2 for part in parts]
        q, scales = parts[0]._empty_panels(sum(counts))
        start = 0
        for part, count in zip(parts, counts):
            part.panels((q[start: start + count], scales[start: start + count]))
            start += count
        return q, scales

    @staticmethod
    def from_panels(format: str, panels: torch.Tensor, scales: torch.Tensor, rows: int | torch.Tensor,
                    in_features: int) -> BlockWeight:
        """The weight that ``panels()`` laid out as (panels, scales; the scales as stored or as their integer bits),
        back in this class's layout, without loss (tests/layers/test_block_quant_linear.py): its first ``rows``
        rows, or the rows a tensor of indices names (an embedding's lookup, BlockEmbedding)."""
        if isinstance(rows, int):
            rows = torch.arange(rows)
        panel, column = rows // 16, rows % 16
        groups = panels.shape[1]
        picked = panels[panel, :, :, column]  # [R, G, bytes]
        if format == "q8":
            packed = picked
        else:  # byte i holds the codes of positions 2i (low nibble) and 2i + 1; the high bits' bytes are the same
            codes = torch.stack([picked[..., :16] & 15, picked[..., :16] >> 4], dim=-1).view(*picked.shape[:2], 32)
            nibbles = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
            packed = torch.cat([nibbles, picked[..., 16:]], dim=-1)
        if format in K_FORMATS:
            supers, halves = groups // (SUPER_BLOCK // BLOCK_SIZE), 1 if format == "q6k" else 2
            # Only the panels the rows are in: reshaping all of them copied a whole head's scales (18 MB at a 128k
            # vocabulary) for every lookup of an embedding.
            used, which = torch.unique(panel, return_inverse=True)
            per_panel = scales.view(torch.uint8).view(scales.shape[0], supers, -1)[used]
            d = per_panel[..., : halves * 32].reshape(-1, supers, halves, 32).view(torch.int16)
            sub = per_panel[..., halves * 32:].reshape(-1, groups, 2, 16)[which, :, :, column]
            return BlockWeight(format, packed.contiguous(),
                               sub.view(torch.int8 if format == "q6k" else torch.uint8).contiguous(), in_features,
                               d[which, :, :, column].contiguous())
        bits = torch.int32 if format in FLOAT32_SCALES else torch.int16
        return BlockWeight(format, packed.contiguous(), scales.view(bits)[panel, :, :, column].contiguous(),
                           in_features)

    def slice(self, rows: slice = slice(None), columns: slice = slice(None)) -> BlockWeight:
        """Rows and input columns of the weight (a tensor-parallel shard); columns only at block boundaries. A K
        format cut inside its super-blocks becomes the same weights with float32 scales (with_float32_scales)."""
        start, stop = columns.start or 0, self.in_features if columns.stop is None else columns.stop
        if start % BLOCK_SIZE or (stop % BLOCK_SIZE and stop != self.in_features):
            raise ValueError(f"columns {start}:{stop} do not fall on blocks of {BLOCK_SIZE}")
        if self.format in K_FORMATS and (start % SUPER_BLOCK or (stop % SUPER_BLOCK and stop != self.in_features)):
            return self.with_float32_scales().slice(rows, columns)
        blocks = slice(start // BLOCK_SIZE, -(-stop // BLOCK_SIZE))
        supers = None
        if self.super_scales is not None:
            supers = self.super_scales[rows, start // SUPER_BLOCK: -(-stop // SUPER_BLOCK)]
        return BlockWeight(self.format, self.packed[rows, blocks], self.scales[rows, blocks], stop - start, supers)

    @staticmethod
    def concat(parts: list[BlockWeight]) -> BlockWeight:
        """The rows of ``parts`` stacked (for the fused q/k/v and gate/up matrices)."""
        if len({(p.format, p.in_features, p.block_shape) for p in parts}) != 1:
            raise ValueError("block weights of different formats or widths cannot be fused")
        if len(parts) == 1:
            return parts[0]
        supers = None if parts[0].super_scales is None else torch.cat([p.super_scales for p in parts])
        return BlockWeight(parts[0].format, torch.cat([p.packed for p in parts]),
                           torch.cat([p.scales for p in parts]), parts[0].in_features, supers)

    @staticmethod
    def fuse(parts: list[BlockWeight]) -> list[BlockWeight]:
        """The rows of ``parts`` stacked, as runs of one format each: a fused matrix whose shards the file stores in
        different types (Gemma 3's Q4_K_M: q and k Q5_0, v Q8_0) keeps each in its own blocks."""
        return [BlockWeight.concat(run) for run in BlockWeight.runs(parts)]

    @staticmethod
    def runs(parts: list[BlockWeight]) -> list[list[BlockWeight]]:
        """``parts`` grouped into runs of one format (what ``fuse`` stacks)."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("block weights of different widths cannot be fused")
        runs = [[parts[0]]]
        for part in parts[1:]:
            if part.format == runs[-1][-1].format:
                runs[-1].append(part)
            else:
                runs.append([part])
        for run in runs:
            if len({(p.in_features, p.block_shape) for p in run}) != 1:
                raise ValueError("block weights of different formats or widths cannot be fused")
        return runs


def _copy_into(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """out[...] = tensor (a strided CPU view of block bytes), copied by numpy: for such byte tensors several times
    faster than torch's copy (model/gguf_file.py's _copy)."""
    np.copyto(out.numpy(), tensor.numpy())


def same_width_int(dtype: torch.dtype) -> torch.dtype:
    return {torch.float16: torch.int16, torch.float32: torch.int32}.get(dtype, dtype)


def _as_floats(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """A panel's scales as the kernel reads them: float16 or float32 values (the K formats' bytes as they are)."""
    if fmt in K_FORMATS:
        return scales
    return scales.view(torch.float32 if fmt in FLOAT32_SCALES else torch.float16)


def dequantized_panel_rows(format: str, panels: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                           in_features: int) -> torch.Tensor:
    """Rows ``rows`` (int64 ids) of a weight laid out in panels (``BlockWeight.panels``; the scales as stored or as
    their integer bits), dequantized exactly, float32 [R, in_features]: by the CPU kernel where it runs, else by
    ``BlockWeight.from_panels``. The same values either way (tests/layers/test_block_quant_linear.py)."""
    kernels = _panel_kernels(panels.device)
    if kernels is not None:
        return kernels.block_panel_rows(panels, _as_floats(scales, format), format, rows, in_features)
    return BlockWeight.from_panels(format, panels, scales, rows, in_features).dequantize()


BF16_DOT_FORMATS = ("q4", "q4k", "q6k", "q8")  # the block formats csrc/bf16_dot_linear.cpp multiplies
# How csrc/decoder_layers.cpp's PanelLinear multiplies a part.
MULTIPLY_FMA, MULTIPLY_BF16_DOT, MULTIPLY_INT8, MULTIPLY_BF16_TILES = 0, 1, 2, 3


class BlockQuantLinear(nn.Module):
    """A linear whose weights stay in the file's 4- to 8-bit blocks (GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the
    K-quants Q4_K / Q5_K / Q6_K).

    On the CPU a C++ kernel reads the blocks: 0.6 bytes a weight for Q4_1 (Q4_K 0.58, with the file's own scales)
    instead of 2 for bfloat16, which is what a memory-bound decode step pays for. ``csrc/panel_linear.cpp``
    (AVX-512, or AVX2 with FMA and F16C) reads them re-laid out in panels of 16 columns (built once here, without
    loss) and multiplies in float32 FMAs by the file's exact weights, each row alone, so rows need no padding.
    Without the kernel (CUDA, no compiler, a CPU without AVX2) the weights are dequantized once to the activation
    dtype and used by a dense matmul. A weight given as several parts (runs of rows in different formats,
    BlockWeight.fuse) is one kernel call per part, their outputs side by side."""

    def __init__(self, weight: BlockWeight | list[BlockWeight], device: str | torch.device = "cpu") -> None:
        super().__init__()
        runs = BlockWeight.runs([weight] if isinstance(weight, BlockWeight) else weight)
        self.formats = tuple(run[0].format for run in runs)
        self.in_features = runs[0][0].in_features
        self.part_features = tuple(sum(part.out_features for part in run) for run in runs)
        self.out_features = sum(self.part_features)
        kernels = self._kernels(torch.device(device))
        for i, run in enumerate(runs):
            if kernels is not None:  # only the kernel's panels are kept: the weight's bytes are in memory once
                panels, scales = BlockWeight.panels_of(run)
                self.register_buffer(f"panels{i}", panels)
                # integer bits, so that casting the model to a dtype leaves them alone (the kernel reads the floats)
                self.register_buffer(f"panel_scales{i}", scales.view(same_width_int(scales.dtype)))
                continue
            part = BlockWeight.concat(run)
            self.register_buffer(f"packed{i}", part.packed.contiguous().to(device))
            self.register_buffer(f"scales{i}", part.scales.contiguous().to(device))
            if part.super_scales is not None:
                self.register_buffer(f"super_scales{i}", part.super_scales.contiguous().to(device))
        self.min_rows: int | None = None
        self._dense: torch.Tensor | None = None
        # The CPU kernel's PanelLinear (csrc/decoder_layers.cpp) over the parts' panels, built with the module on the
        # CPU (else on its first CPU call): calls go straight to it and build no BlockWeight objects (which cost a
        # one-row decode step 0.8 ms of Python, 121 linears). It multiplies each part as ``_sync_kernel`` tells it
        # from the three settings below.
        self.kernel = None
        self._kernels_module = None
        # "bf16": bfloat16 activations times q4, q4k, q6k and q8 blocks by bfloat16 dot products; set by
        # use_dot_products (EngineConfig.block_dot_products)
        self._dot_products = "fma"
        # float32 results where the kernel computes them so (the logits: in bfloat16, scores 1/8 apart tie)
        self._float_output = False
        # "int8": the kernel quantizes the activations per row and block of 32 (csrc/int8_linear.cpp), for every
        # row count alike; set by use_activation_quantization (EngineConfig.activation_quantization)
        self._activation_quantization = "none"
        if kernels is not None:
            self._build_kernel(kernels)

    @property
    def dot_products(self) -> str:
        return self._dot_products

    @dot_products.setter
    def dot_products(self, value: str) -> None:
        self._dot_products = value
        self._sync_kernel()

    @property
    def float_output(self) -> bool:
        return self._float_output

    @float_output.setter
    def float_output(self, value: bool) -> None:
        self._float_output = value
        self._sync_kernel()

    @property
    def activation_quantization(self) -> str:
        return self._activation_quantization

    @activation_quantization.setter
    def activation_quantization(self, value: str) -> None:
        self._activation_quantization = value
        self._sync_kernel()

    def _sync_kernel(self) -> None:
        """Tells the kernel how to multiply each part: int8 activations for all where asked and compiled, else
        bfloat16 dot products for the formats csrc/bf16_dot_linear.cpp takes (for bfloat16 rows) where asked and
        compiled (on AMX tiles with "amx"), else float32 FMAs."""
        if self.kernel is None:
            return
        kernels = self._kernels_module
        if self._activation_quantization == "int8" and kernels.block_int8_kernel_available():
            multiply = [MULTIPLY_INT8] * len(self.formats)
        else:
            bf16_dot = {"bf16": MULTIPLY_BF16_DOT, "amx": MULTIPLY_BF16_TILES}.get(self._dot_products)
            if not kernels.block_bf16_dot_kernel_available():
                bf16_dot = None
            multiply = [bf16_dot if bf16_dot is not None and fmt in BF16_DOT_FORMATS else MULTIPLY_FMA
                        for fmt in self.formats]
        self.kernel.set_multiply(multiply, self._float_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2 and x.shape[0] and x.is_cpu:
            # The kernel is built: rows [M, in] go straight to it, with no reshape, padding or kernel lookup to
            # pass (121 calls a decode step).
            return self.kernel(x)
        if self.min_rows is None and self._kernels(x.device) is not None:
            # The kernel computes each row alone (csrc/panel_linear.cpp): no padding to probe for
            # (tests/layers/test_block_quant_linear.py::test_each_row_is_the_same_whatever_the_batch).
            self.min_rows = 1
        return _row_invariant_forward(self, x, (self.formats, self.out_features, self.in_features))

    @staticmethod
    def _kernels(device: torch.device):
        return _panel_kernels(device)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels(x.device)
        if kernels is not None:
            if self.kernel is None:
                self._build_kernel(kernels)
            return self.kernel(x)
        if self._dense is None or self._dense.dtype != x.dtype:
            dense = torch.cat([part.dequantize() for part in self.block_weights()])
            self._dense = dense.to(device=x.device, dtype=x.dtype)
        return F.linear(x, self._dense)

    def _build_kernel(self, kernels) -> None:
        """The kernel over the panels (laid out now where the module holds blocks)."""
        if not hasattr(self, "panels0"):
            panels = [part.panels() for part in self.block_weights()]
        else:
            panels = [(getattr(self, f"panels{i}"), _as_floats(getattr(self, f"panel_scales{i}"), fmt))
                      for i, fmt in enumerate(self.formats)]
        self.kernel = kernels.PanelLinear([p for p, _ in panels], [s for _, s in panels], list(self.formats),
                                          list(self.part_features))
        self._kernels_module = kernels
        self.min_rows = 1  # each row alone, as in forward
        self._sync_kernel()

    def block_weights(self) -> list[BlockWeight]:
        """The weight's parts, each in one format, in row order (rebuilt from the panels where only they are kept)."""
        if hasattr(self, "panels0"):
            return [BlockWeight.from_panels(fmt, getattr(self, f"panels{i}").cpu(),
                                            getattr(self, f"panel_scales{i}").cpu(), rows, self.in_features)
                    for i, (fmt, rows) in enumerate(zip(self.formats, self.part_features))]
        parts = []
        for i, fmt in enumerate(self.formats):
            supers = getattr(self, f"super_scales{i}", None)
            parts.append(BlockWeight(fmt, getattr(self, f"packed{i}").cpu(), getattr(self, f"scales{i}").cpu(),
                                     self.in_features, None if supers is None else supers.cpu()))
        return parts


@torch.inference_mode()
def probe_row_padding(model: nn.Module, dtype: torch.dtype) -> None:
    """Probes every linear's row padding now, so that the first request does not pay for it."""
    for module in model.modules():
        if isinstance(module, (Linear, Int8Linear, BlockQuantLinear)) and module.min_rows is None:
            device = next(itertools.chain(module.parameters(), module.buffers())).device
            module(torch.zeros(1, module.in_features, dtype=dtype, device=device))
        elif hasattr(module, "probe_row_padding") and module.min_rows is None:  # stacked experts (layers/moe.py)
            module.probe_row_padding(dtype)


def amx_bfloat16_gemms() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on AMX tiles here. Padded to 64 rows, they ran 3x to 7x the dense kernel's
    speed from 64 rows up, even at 16, while the kernel (float32 FMA chains) was 2-6x faster at 1 to 4 rows
    (benchmarks/README.md, "Dense weights on the panel kernel")."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def lay_out_for_cpu_kernels(model: nn.Module, bfloat16_linears: bool | None = None) -> int:
    """Stores the dense weights of ``model`` transposed in memory, W^T [in, out] row-major, where the CPU kernels
    run: the layout their dense linear reads (csrc/panel_linear.cpp), with no row padding. The parameter keeps its
    shape [out, in] and values (a transposed view), so a tied head stays the embedding's parameter and there is
    one copy. Their row paddings are probed again (1). Returns how many weights were re-laid (0 off the CPU or
    without the kernels).

    Which: every module's ``dense_weights()`` (the stacked experts of layers/moe.py: an expert sees a k / experts
    share of a step's rows, which a padded matmul per expert would multiply up), every float32 Linear (MKL's
    float32 GEMMs were no faster than the kernel at many rows), and the bfloat16 Linears if ``bfloat16_linears``
    (default: unless ``amx_bfloat16_gemms()``, where a Linear's whole step of rows, a prefill chunk or a large
    decode batch, runs faster padded on oneDNN)."""
    if bfloat16_linears is None:
        bfloat16_linears = not amx_bfloat16_gemms()
    laid = 0
    for module in model.modules():
        if isinstance(module, Linear):
            weights = [module.weight] if bfloat16_linears or module.weight.dtype != torch.bfloat16 else []
        else:
            weights = getattr(module, "dense_weights", list)()
        for weight in weights:
            if (weight.dtype in DENSE_KERNEL_DTYPES and not weight.transpose(-1, -2).is_contiguous()
                    and _panel_kernels(weight.device) is not None):
                weight.data = _transposed_in_huge_pages(weight.data)
                module.min_rows = None
                laid += 1
    return laid


def _transposed_in_huge_pages(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [..., out, in] as the [..., out, in] view of its W^T [..., in, out] row-major, in huge pages (each
    decode step streams it)."""
    laid = empty_in_huge_pages((*weight.shape[:-2], weight.shape[-1], weight.shape[-2]), weight.dtype)
    laid.copy_(weight.transpose(-1, -2))
    return laid.transpose(-1, -2)


def largest_row_padding(model: nn.Module) -> int:
    """The largest row count any of ``model``'s probed linears pads its input to (1 when none was probed): a batch of
    fewer rows costs every such linear as many rows, plus the padding's copies."""
    paddings = [1]
    for module in model.modules():
        min_rows = getattr(module, "min_rows", None)
        if isinstance(min_rows, int):
            paddings.append(min_rows)
        elif isinstance(min_rows, tuple):  # stacked experts: one per matmul
            paddings += min_rows
    return max(paddings)


def use_activation_quantization(model: nn.Module, method: str) -> str:
    """Sets how ``model``'s block linears multiply (EngineConfig.activation_quantization): "none", float32
    activations; "int8", activations quantized per row and block of 32 and integer dot products, on a CPU with the
    kernel (elsewhere the float path stays); "auto", int8 where it measured faster here (``int8_activations_faster``).
    Returns the choice made ("none" for "auto" where the model has no block linear on the CPU or the kernel was not
    compiled)."""
    if method not in ACTIVATION_QUANTIZATION_CHOICES:
        raise ValueError(f"activation_quantization must be one of {ACTIVATION_QUANTIZATION_CHOICES}, got {method!r}")
    linears = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    if method == "auto":
        on_cpu = [m for m in linears if next(m.buffers()).is_cpu]
        kernels = _panel_kernels(torch.device("cpu")) if on_cpu else None
        available = kernels is not None and kernels.block_int8_kernel_available()
        method = "int8" if available and int8_activations_faster() else "none"
    for linear in linears:
        linear.activation_quantization = method
    return method




def use_dot_products(model: nn.Module, choice: str) -> str:
    """Sets how ``model``'s block linears multiply bfloat16 activations with q4, q4k, q6k and q8 blocks
    (EngineConfig.block_dot_products): "fma", float32 FMAs on the decoded weights; "bf16", bfloat16 dot products
    on the codes; "amx", the same on AMX tiles at every row count; "auto", the one that measured fastest on this CPU
    (``auto_dot_products``). Returns the choice made ("fma" where the model has no such linear on the CPU or the
    kernel was not compiled; "bf16" for "amx" where the CPU has no AMX-BF16)."""
    if choice not in BLOCK_DOT_PRODUCT_CHOICES:
        raise ValueError(f"block_dot_products must be one of {BLOCK_DOT_PRODUCT_CHOICES}, got {choice!r}")
    linears = [m for m in model.modules() if isinstance(m, BlockQuantLinear)
               and set(m.formats) & set(BF16_DOT_FORMATS) and next(m.buffers()).is_cpu]
    kernels = _panel_kernels(torch.device("cpu")) if linears else None
    available = kernels is not None and kernels.block_bf16_dot_kernel_available()
    if choice == "auto":
        choice = auto_dot_products() if available else "fma"
    elif choice in ("bf16", "amx") and linears and not available:
        logger.warning("--block-dot-products %s: this CPU or build has no AVX-512 BF16; using fma", choice)
        choice = "fma"
    if choice == "amx" and linears and not kernels.bf16_dot_tiles_available():
        logger.warning("--block-dot-products amx: this CPU or build has no AMX-BF16 tiles; using bf16")
        choice = "bf16"
    if linears and kernels is not None and choice == "bf16":
        kernels.set_bf16_dot_fma_rows(dot_product_measurement()["bf16_fma_rows"])
    for linear in linears:
        linear.dot_products = choice
    return choice


_dot_product_measurement: dict[str, dict] = {}


def dot_product_measurement() -> dict:
    """Both kernels timed on this CPU (``_measure_dot_products``), measured once per build of the kernels and kept
    beside it (the same CPU kind, the same code), with "bf16_fma_rows": from how many rows the dot-product kernel
    takes its FMA path, where that path has its bits here and measured faster at 16 rows (0: never)."""
    if "record" in _dot_product_measurement:
        return _dot_product_measurement["record"]
    kernels = _panel_kernels(torch.device("cpu"))
    record = Path(kernels.__file__).with_suffix(".dot_products.json")
    try:
        measured = json.loads(record.read_text())
        if measured.get("method") != DOT_PRODUCT_METHOD:  # an earlier version's record: measured again
            raise ValueError(record)
    except (OSError, ValueError):
        measured = _measure_dot_products(kernels)
        try:
            record.write_text(json.dumps(measured))
        except OSError:
            pass
    by_fmas = measured.get("bf16_fmas_16")
    measured["bf16_fma_rows"] = BF16_DOT_FMA_ROWS if by_fmas is not None and by_fmas < measured["bf16_16"] else 0
    _dot_product_measurement["record"] = measured
    return measured


def auto_dot_products() -> str:
    """"auto"'s choice of block_dot_products on this CPU: "bf16" where the dot products measured faster than the
    FMAs (``bf16_dot_products_faster``), else "fma"; then "amx" over that where the tiles measured faster
    (``amx_tiles_faster``)."""
    choice = "bf16" if bf16_dot_products_faster() else "fma"
    return "amx" if amx_tiles_faster(choice) else choice


def amx_tiles_faster(other: str) -> bool:
    """Whether the dot products on AMX tiles beat ``other`` ("bf16" or "fma") in ``dot_product_measurement`` (timed
    only where the tiles are usable): at least MARGIN faster at 16 rows and at most AMX_ONE_ROW_SLACK slower at one.
    The one-row timing is of a small weight in cache on one thread, which the tiles' prefetches do not help, where a
    model's one-row decode reads its weights from memory: there the tiles measured 1.09-1.14x the dot products' rate,
    and 3-4x from 8 rows, on an Intel Xeon (Emerald Rapids; benchmarks/README.md, "AMX tiles for the dot products" and
    "The tiles ask for their next blocks"), while this timing put them 0.85-1.14x the dot products' time at one row
    from one start to the next."""
    measured = dot_product_measurement()
    if "amx_1" not in measured:
        return False
    other_16 = measured["fma_16"] if other == "fma" else _bf16_16(measured)
    faster = (measured["amx_1"] <= AMX_ONE_ROW_SLACK * measured[f"{other}_1"]
              and DOT_PRODUCT_MARGIN * measured["amx_16"] <= other_16)
    logger.info("block linears: %s (q4 3072 x 576, us a call, %s/amx: 1 row %.0f/%.0f, 16 rows %.0f/%.0f)",
                "the dot products on AMX tiles" if faster else f"not AMX tiles ({other})", other,
                measured[f"{other}_1"], measured["amx_1"], other_16, measured["amx_16"])
    return faster


def bf16_dot_products_faster() -> bool:
    """Whether the bfloat16 dot-product kernel is the better one on this CPU: a q4 linear of 3072 x 576 (a gate/up
    projection's shape) at 1 and at 16 rows, the kernels alternated on this thread alone, medians of its CPU time
    (``dot_product_measurement``; at 16 rows by the dot products' faster path). bf16 must be at least MARGIN faster
    at one row (a decode step of one stream, which waits on nothing else) and at most MARGIN slower at 16 (a batch's
    or a prefill chunk's rows), so that a near tie does not flip between starts. On an Intel Xeon the dot products
    were 1.5x faster at one row and, by their FMA path, 1.09x faster at 16; through the server, in one run, one
    stream 1.55x the float32 kernel's tokens/s, decode-heavy 0.95x and the mixed workload's wall time 1.08x
    (benchmarks/README.md, "Dot products as FMAs")."""
    measured = dot_product_measurement()
    bf16_16 = _bf16_16(measured)
    faster = (measured["fma_1"] >= DOT_PRODUCT_MARGIN * measured["bf16_1"]
              and bf16_16 <= DOT_PRODUCT_MARGIN * measured["fma_16"])
    logger.info("block linears: %s (q4 3072 x 576, us a call, fma/bf16: 1 row %.0f/%.0f, 16 rows %.0f/%.0f%s)",
                "bfloat16 dot products" if faster else "float32 FMAs", measured["fma_1"], measured["bf16_1"],
                measured["fma_16"], bf16_16, f", bf16 from {measured['bf16_fma_rows']} rows by FMAs"
                if measured["bf16_fma_rows"] else "")
    return faster


def int8_activations_faster() -> bool:
    """Whether int8 activations (csrc/int8_linear.cpp) beat every float32-sum kernel timed here
    (``dot_product_measurement``, the same q4 linear of 3072 x 576): at least MARGIN faster at one row and at most
    MARGIN slower at 16, as ``bf16_dot_products_faster`` asks of the dot products. Their cost in quality, perplexity
    within 0.3% of the float kernel's on both embedded models, is in benchmarks/README.md ("Int8 activations by
    default where they measure faster")."""
    measured = dot_product_measurement()
    if "int8_1" not in measured:
        return False
    float_1 = min(measured[f"{way}_1"] for way in ("fma", "bf16", "amx") if f"{way}_1" in measured)
    float_16 = min(measured["fma_16"], _bf16_16(measured) if "bf16_16" in measured else measured["fma_16"],
                   measured.get("amx_16", measured["fma_16"]))
    faster = float_1 >= DOT_PRODUCT_MARGIN * measured["int8_1"] and measured["int8_16"] <= DOT_PRODUCT_MARGIN * float_16
    logger.info("block linears: %s (q4 3072 x 576, us a call, fastest float/int8: 1 row %.0f/%.0f, 16 rows %.0f/%.0f)",
                "int8 activations" if faster else "float activations", float_1, measured["int8_1"], float_16,
                measured["int8_16"])
    return faster


def _bf16_16(measured: dict) -> float:
    """The dot products' time at 16 rows by their faster path (the FMA path where it was timed)."""
    return min(measured["bf16_16"], measured.get("bf16_fmas_16") or measured["bf16_16"])


DOT_PRODUCT_MARGIN = 1.1
# How much slower than the other kernel the tiles may time at one row and still be chosen (amx_tiles_faster): a
# margin of 1.1 there let one start's timing (1.14x) take the dot products for every row count, and decode-heavy
# through the server fell to half (benchmarks/README.md, "The tiles ask for their next blocks").
AMX_ONE_ROW_SLACK = 1.25
# How the record beside the build was measured: on one thread. On two, a start under load (a test suite beside it)
# measured both kernels 75x slow and chose the FMAs for good: the main thread's CPU time went on spinning at the
# kernels' OpenMP barrier while the other worker waited for a core. The dot products' FMA path and the AMX tiles
# are timed too.
DOT_PRODUCT_METHOD = "one thread; bf16 at 16 rows by either path; amx where the tiles are usable; int8 activations"
# From how many rows the dot-product kernel may take its FMA path: past one pass of its 6-row register tile.
BF16_DOT_FMA_ROWS = 7


def _measure_dot_products(kernels) -> dict[str, float | str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {**_time_dot_products(kernels), "method": DOT_PRODUCT_METHOD}
    finally:
        torch.set_num_threads(threads)


def random_q4_weight(n: int, k: int, generator: torch.Generator) -> BlockWeight:
    """A q4 BlockWeight of n x k with random codes and scales (the kernels' timings)."""
    return BlockWeight("q4", torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=generator),
                       (torch.rand(n, k // 32, 2, generator=generator) / 64).half().view(torch.int16), k)


def _time_dot_products(kernels) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    n, k = 3072, 576
    panels = random_q4_weight(n, k, generator).panels()
    ways = [("fma", 0, kernels.block_panel_linear)]
    if kernels.block_bf16_dot_kernel_available():
        ways.append(("bf16", 0, kernels.block_panel_linear_bf16_dot))
        if kernels.bf16_dot_is_two_fmas():  # the FMA path, timed from its first row
            ways.append(("bf16_fmas", 1, kernels.block_panel_linear_bf16_dot))
        if kernels.bf16_dot_tiles_available():
            ways.append(("amx", 0, functools.partial(kernels.block_panel_linear_bf16_dot, tiles=True)))
    if kernels.block_int8_kernel_available():
        ways.append(("int8", 0, kernels.block_panel_linear_int8))
    times: dict[str, list[float]] = {}
    try:
        for _ in range(7):
            for rows in (1, 16):
                x = torch.randn(rows, k, generator=generator).bfloat16()
                for name, fma_rows, linear in ways:
                    if name == "bf16_fmas" and rows == 1:
                        continue
                    kernels.set_bf16_dot_fma_rows(fma_rows)
                    calls = 64 // rows + 2
                    start = time.thread_time()
                    for _ in range(calls):
                        linear(x, *panels, "q4", n, False)
                    times.setdefault(f"{name}_{rows}", []).append((time.thread_time() - start) / calls * 1e6)
    finally:
        kernels.set_bf16_dot_fma_rows(0)
    return {key: statistics.median(values) for key, values in times.items()}


QUANTIZATIONS = ("int8",)


def quantize_linears(model: nn.Module, method: str) -> int:
    """Swaps every Linear of ``model`` for its quantized form; returns how many were swapped."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear(child.weight))
                swapped += 1
    return swapped
