"""Attention over a paged KV cache.

The flat token batch holds the decodes first (one query token each), then the prefill chunks.
Each layer writes its new keys and values into the cache slots named by ``slot_mapping``, then
attends: all decodes together in one batched call over their gathered blocks, each prefill
chunk on its own (there are few per step, and each is many tokens).

Batch invariance: a query's result must not depend on which other queries share the step, how far
its keys were padded, or whether it came in a prefill chunk or a decode — else greedy output changes
with batch composition, chunking and preemption. On the CPU a C++ kernel (``csrc/paged_attention.cpp``)
computes each query on its own over its own prefix, reading the cache in place. Elsewhere (or where the
kernel cannot be built) CPU/GPU matmul kernels sum in an order that depends on the shapes, so decodes and
prefills share one routine that does the arithmetic in float64: the products of 16- and 32-bit inputs are
exact there and the sums so close to exact that the result no longer depends on the order.

The cache holds each token's keys and values in the model's dtype, or quantized (``--kv-cache-dtype``): a row of
head_dim 8-bit codes (int8, float8_e4m3fn or float8_e5m2) followed by that row's float32 scale, one row per token
and key/value head. A row's scale comes from that row alone (its largest |value| maps to the code's largest), so a
token's cached bytes never depend on what else shares its block or its step, and every path reads the cache, never
the unquantized keys, so decodes and prefills see the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serval.layers import cpu_kernels

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
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, width, dtype=dtype, device=device)


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
    [num_blocks, block_size, KVH, row]."""
    num_kv_heads, width = cache.shape[2], cache.shape[3]
    if not is_quantized(cache):
        cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, x)
    elif x.device.type == "cpu" and (kernels := cpu_kernels.load()) is not None:
        kernels.quantize_kv_(x.contiguous(), cache, slot_mapping)
    else:
        rows = quantize_rows(x, cache.dtype)
        cache.view(torch.uint8).view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, rows)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The cache's blocks ``block_ids`` [N] as [N, block_size, KVH, D] values (dequantized when 8-bit)."""
    if not is_quantized(cache):
        return cache.index_select(0, block_ids)
    return dequantize_rows(cache.view(torch.uint8).index_select(0, block_ids), cache.dtype)


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the flat batch
    query_len: int
    seq_len: int  # tokens of context after this chunk (cached + new)
    block_table: torch.Tensor  # [ceil(seq_len / block_size)] block ids
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None when the chunk is the whole sequence (plain causal)


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's flat batch; built once per step by the runner."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks]
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool: key is in context
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Per token, for the CPU kernel: every scheduled sequence's block table [S, max_blocks], each token's row in
    # it [T], and how many keys each token attends to [T] (its position + 1).
    block_tables: torch.Tensor | None = None
    token_table: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], or [.., KVH, D + 4] 8-bit rows
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # attend to each query's last ``window`` keys only (a sliding-window layer)
) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], q.shape[2]
    kernels = cpu_kernels.load() if q.device.type == "cpu" else None
    if kernels is not None and not is_quantized(k_cache) and k.stride(-1) == 1 and k.stride(-2) == head_dim \
            and v.stride(-1) == 1 and v.stride(-2) == head_dim:
        kernels.write_kv_(k_cache, v_cache, k, v, meta.slot_mapping)  # both in one call
    else:
        write_kv(k_cache, k, meta.slot_mapping)
        write_kv(v_cache, v, meta.slot_mapping)
    if meta.token_table is not None and kernels is not None:
        return kernels.paged_attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.token_table,
                                       meta.context_lens, scale, window or 0)

    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        tables = meta.decode_block_tables
        # index_select, not k_cache[tables]: advanced indexing with a 2-D index is ~100x slower on CPU.
        shape = (tables.shape[0], tables.shape[1] * block_size, num_kv_heads, head_dim)
        keys = _gather_blocks(k_cache, tables.flatten()).view(shape).transpose(1, 2)  # [D, KVH, L, dim]
        values = _gather_blocks(v_cache, tables.flatten()).view(shape).transpose(1, 2)
        # One query per sequence, its heads grouped under their key/value head: [D, KVH, heads per KV head, dim].
        query = q[:num_decodes].view(num_decodes, num_kv_heads, -1, head_dim)
        mask = meta.decode_mask
        if window:  # each decode's position is its number of keys in context, minus one
            positions = mask.sum(-1, keepdim=True) - 1
            mask = mask & (torch.arange(mask.shape[-1], device=q.device) > positions - window)
        attn = _attend(query, keys, values, mask, scale)
        out[:num_decodes] = attn.view(num_decodes, -1, head_dim)
    for chunk in meta.prefills:
        start, end = chunk.query_start, chunk.query_start + chunk.query_len
        if chunk.mask is None and not is_quantized(k_cache):  # no earlier context: the chunk's own keys, causal
            keys, values = k[start:end], v[start:end]
        else:  # (a quantized cache is always read back: decodes see the same values)
            keys = _gather_blocks(k_cache, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
            values = _gather_blocks(v_cache, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
        mask = chunk.mask
        if mask is None:
            mask = torch.ones(chunk.query_len, chunk.query_len, dtype=torch.bool, device=q.device).tril_()
        if window:
            q_pos = torch.arange(chunk.seq_len - chunk.query_len, chunk.seq_len, device=q.device)
            mask = mask & (torch.arange(mask.shape[-1], device=q.device)[None, :] > q_pos[:, None] - window)
        # A chunk's queries as rows [KVH, Q * heads per KV head, dim] against keys [KVH, L, dim].
        q_len, group = chunk.query_len, q.shape[1] // num_kv_heads
        query = q[start:end].view(q_len, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, -1,
                                                                                                 head_dim)
        rows_mask = mask[:, None, :].expand(-1, group, -1).reshape(q_len * group, -1)
        attn = _attend(query, keys.transpose(0, 1), values.transpose(0, 1), rows_mask, scale)
        out[start:end] = attn.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(q_len, -1, head_dim)
    return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64, cast back to the query's dtype.

    query [..., M, dim], keys and values [..., L, dim], mask broadcastable to [..., M, L] (True: the key is in
    context)."""
    scores = torch.matmul(query.double(), keys.double().transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.double()).to(query.dtype)
