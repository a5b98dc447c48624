"""The paged KV cache tensor and the rows it holds, shared by every attention backend.

The cache holds each token's keys and values in the model's dtype, or quantized (``--kv-cache-dtype``): a row of
head_dim 8-bit codes (int8, float8_e4m3fn or float8_e5m2) followed by that row's float32 scale, one row per token
and key/value head. A row's scale comes from that row alone (its largest |value| maps to the code's largest), so a
token's cached bytes never depend on what else shares its block or its step, and every backend reads the cache, never
the unquantized keys, so decodes and prefills see the same values.
"""

from __future__ import annotations

import math
import mmap

import torch

# The 8-bit cache formats: the code dtype and its largest magnitude (a row's largest |value| maps to it).
KV_CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_MAX_CODE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 4  # a row's float32 scale, after its codes


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _MAX_CODE


def new_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[layer, k/v, block, slot, kv head, row]: rows of head_dim values of ``dtype``, or of head_dim 8-bit codes and
    a scale when ``dtype`` is a code dtype."""
    width = head_dim + SCALE_BYTES if dtype in _MAX_CODE else head_dim
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, width)
    if torch.device(device).type == "cpu":
        return _zeros_from_the_os(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _zeros_from_the_os(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, made by an anonymous memory map: fresh pages, which the OS
    hands out zeroed as each is first written, where torch.zeros writes every byte at once (1 GiB of cache: 1.2 s of
    a start). In pages of 4 KiB: numpy's zeros (calloc) asked for transparent huge pages, and each first write to a
    2 MiB page then zeroed all of it, two a layer for a request's first tokens (a 1B's first request: 80 ms against
    33 for the next, 35 of them in the kernel's clear_page; tests/layers/test_kv_quantization.py). Page-aligned, so each
    row starts on a cache line."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (where the OS gives huge pages unasked)
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def quantize_rows(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as 8-bit cache rows [..., D + 4] (bytes): codes x / scale, rounded to nearest even, then the
    float32 scale = max |x| / the largest code (1 for a row of zeros). The CPU kernel's quantize_kv_ gives the same
    bytes."""
    values = x.float()
    amax = values.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _MAX_CODE[code_dtype], torch.ones_like(amax))
    scaled = values / scale
    if code_dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(code_dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """8-bit cache rows [..., D + 4] (bytes) as float32 [..., D]: code * scale, as the CPU kernel reads them."""
    codes = rows[..., :-SCALE_BYTES].contiguous().view(code_dtype).float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return codes * scale


def write_kv(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores x [T, KVH, D] (one layer's new keys or values) at the flat slots ``slot_mapping`` of ``cache``
    [num_blocks, block_size, KVH, row], in PyTorch (the CPU kernels store the same bytes)."""
    num_kv_heads, width = cache.shape[2], cache.shape[3]
    if not is_quantized(cache):
        cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, x)
    else:
        rows = quantize_rows(x, cache.dtype)
        cache.view(torch.uint8).view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, rows)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The cache's blocks ``block_ids`` [N] as [N, block_size, KVH, D] values (dequantized when 8-bit)."""
    if not is_quantized(cache):
        return cache.index_select(0, block_ids)
    return dequantize_rows(cache.view(torch.uint8).index_select(0, block_ids), cache.dtype)
