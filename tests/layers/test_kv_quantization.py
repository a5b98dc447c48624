"""The 8-bit KV cache (int8, float8 e4m3 and e5m2 codes with a float32 scale per row): the C++ writer and the
PyTorch one store the same bytes, a row comes back within its code's rounding error, and attention over such a
cache (kernel and float64 path) is the same for a query alone, batched or in a chunk, and matches a float64 softmax
over the dequantized keys and values."""

from __future__ import annotations

import pytest
import torch
from test_attention import BLOCK, DIM, HEADS, KV_HEADS, _decode, _prefill_chunk

from serval.layers import cpu_kernels
from serval.layers.attention import KV_CODE_DTYPES, dequantize_rows, new_kv_cache, quantize_rows, write_kv

CODES = list(KV_CODE_DTYPES.values())
# Per element, |dequantized - x| <= relative * |x| + absolute * scale: int8 rounds to half a step of the row's scale;
# the float8 codes to half an ulp of their 3 (e4m3) or 2 (e5m2) mantissa bits, subnormals to half their step.
BOUNDS = {torch.int8: (0.0, 0.5), torch.float8_e4m3fn: (2**-4, 2**-10), torch.float8_e5m2: (2**-3, 2**-17)}


def _values(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, KV_HEADS, DIM, generator=gen) * torch.logspace(-3, 2, 37)[:, None, None]
    x[5, 1] = 0  # a row of zeros: scale 1, codes 0
    return x.to(dtype)


@pytest.mark.parametrize("code_dtype", CODES, ids=list(KV_CODE_DTYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_and_pytorch_write_the_same_bytes_within_the_codes_error(code_dtype, dtype):
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    x = _values(dtype)
    slots = torch.randperm(4 * BLOCK, generator=torch.Generator().manual_seed(2))[: x.shape[0]]
    by_kernel = new_kv_cache(1, 4, BLOCK, KV_HEADS, DIM, code_dtype, "cpu")[0, 0]
    by_torch = by_kernel.clone()
    kernels.quantize_kv_(x, by_kernel, slots)
    by_torch.view(torch.uint8).view(-1, KV_HEADS, DIM + 4).index_copy_(0, slots, quantize_rows(x, code_dtype))
    assert torch.equal(by_kernel.view(torch.uint8), by_torch.view(torch.uint8))

    rows = by_kernel.view(torch.uint8).view(-1, KV_HEADS, DIM + 4)[slots]
    back = dequantize_rows(rows, code_dtype)
    scale = rows[..., DIM:].contiguous().view(torch.float32)
    assert torch.equal(scale[5, 1], torch.ones(1)) and not back[5, 1].any()
    relative, absolute = BOUNDS[code_dtype]
    exact = x.float()
    assert ((back - exact).abs() <= relative * exact.abs() + absolute * scale * 1.0001).all()
    amax = exact.abs().amax(-1, keepdim=True)
    assert torch.allclose(back.abs().amax(-1, keepdim=True), amax, rtol=1e-6)  # the largest value is exact


def _quantized_setup(code_dtype):
    """The bf16 cache of test_attention's cases, written through ``write_kv`` into 8-bit rows."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 32 * BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    queries = torch.randn(300, HEADS, DIM, generator=gen).to(torch.bfloat16)
    cache = new_kv_cache(1, 32, BLOCK, KV_HEADS, DIM, code_dtype, "cpu")[0]
    for i in range(2):
        write_kv(cache[i], values[i], torch.arange(32 * BLOCK))
    return cache, queries


class _Rewritten:
    """Stands in for test_attention's cache: ``cache[0].view(-1, KVH, DIM)[slots]`` gives the dequantized keys that
    the step writes back (the same bytes again, as a real step's new keys would quantize)."""

    def __init__(self, cache):
        self.cache = cache

    def __getitem__(self, i):
        return _Dequantized(self.cache[i])


class _Dequantized:
    def __init__(self, cache):
        self.cache = cache

    def view(self, *shape):
        rows = self.cache.view(torch.uint8).view(-1, KV_HEADS, DIM + 4)
        return dequantize_rows(rows, self.cache.dtype).to(torch.bfloat16)


@pytest.mark.parametrize("path", ["cpu_kernel", "float64"])
@pytest.mark.parametrize("code_dtype", CODES, ids=list(KV_CODE_DTYPES))
@torch.inference_mode()
def test_attention_over_8bit_rows_is_the_same_alone_batched_or_in_a_chunk(code_dtype, path, monkeypatch):
    cache, queries = _quantized_setup(code_dtype)
    written = cache.view(torch.uint8).clone()
    import test_attention

    # test_attention's helpers read the new keys from cache[i].view(...)[slots] and pass cache[0], cache[1] on.
    monkeypatch.setattr(test_attention, "paged_attention", _with_real_caches(cache))
    rewritten = _Rewritten(cache)
    a_blocks, b_blocks, c_blocks = [3, 7, 1], [0, 2, 4, 5, 6, 8, 9, 10, 11, 12], [13, 14]
    alone = _decode(rewritten, queries, [(a_blocks, 40)], path)[0]
    batched = _decode(rewritten, queries, [(b_blocks, 150), (a_blocks, 40), (c_blocks, 20)], path)[1]
    assert torch.equal(alone, batched)
    assert torch.equal(alone, _prefill_chunk(rewritten, queries, a_blocks, 30, 40, path)[-1])
    assert torch.equal(alone, _prefill_chunk(rewritten, queries, a_blocks, 0, 40, path)[-1])
    assert torch.equal(cache.view(torch.uint8), written)  # writing a row's own values back changes no byte

    chunk = _prefill_chunk(rewritten, queries, a_blocks, 0, 40, path).double()
    keys, values = (dequantize_rows(cache[i].view(torch.uint8)[a_blocks], code_dtype).flatten(0, 1)[:40].double()
                    .repeat_interleave(HEADS // KV_HEADS, dim=1) for i in range(2))
    scores = torch.einsum("qhd,khd->hqk", queries[:40].double(), keys) * DIM**-0.5
    scores.masked_fill_(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    assert (chunk - want).abs().max() < 0.01  # the output is bf16: its own rounding, nothing more


def _with_real_caches(cache):
    from serval.layers.attention import paged_attention

    def call(q, k, v, _k_cache, _v_cache, meta, scale):
        return paged_attention(q, k, v, cache[0], cache[1], meta, scale)
    return call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_a_cpu_kv_cache_is_zeros_in_one_block_of_memory_on_a_cache_line(dtype):
    """Made by the OS's zeroed pages (no 1 GiB of zeros written at start), it is still torch.zeros's tensor."""
    cache = new_kv_cache(2, 5, 16, 3, 64, dtype, "cpu")
    want = torch.zeros(2, 2, 5, 16, 3, 64 + (4 if dtype in (torch.int8, torch.float8_e4m3fn) else 0), dtype=dtype)
    assert cache.dtype == dtype and cache.shape == want.shape and cache.is_contiguous()
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)) and cache.data_ptr() % 64 == 0
    cache[1, 1, 4, 15, 2, -1] = 1  # writable to its last element


def test_a_cpu_kv_cache_is_in_small_pages():
    """Its mapping asks for no transparent huge pages (smaps' VmFlags "nh"): each first write of a request's rows
    then zeroes 4 KiB, not the 2 MiB that made a 1B's first request cost 2.4x the next."""
    cache = new_kv_cache(2, 64, 16, 8, 64, torch.bfloat16, "cpu")  # 4 MiB, past numpy's huge-page threshold
    cache[0, 0, 0, 0, 0, 0] = 1
    address, flags = cache.data_ptr(), None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                start, end = (int(part, 16) for part in line.split()[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None and "nh" in flags
