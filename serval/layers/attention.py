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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serval.layers import cpu_kernels


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
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if meta.token_table is not None and q.device.type == "cpu" and (kernels := cpu_kernels.load()) is not None:
        return kernels.paged_attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.token_table,
                                       meta.context_lens, scale)

    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        tables = meta.decode_block_tables
        # index_select, not k_cache[tables]: advanced indexing with a 2-D index is ~100x slower on CPU.
        shape = (tables.shape[0], tables.shape[1] * block_size, num_kv_heads, head_dim)
        keys = k_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)  # [D, KVH, L, dim]
        values = v_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
        # One query per sequence, its heads grouped under their key/value head: [D, KVH, heads per KV head, dim].
        query = q[:num_decodes].view(num_decodes, num_kv_heads, -1, head_dim)
        attn = _attend(query, keys, values, meta.decode_mask, scale)
        out[:num_decodes] = attn.view(num_decodes, -1, head_dim)
    for chunk in meta.prefills:
        start, end = chunk.query_start, chunk.query_start + chunk.query_len
        if chunk.mask is None:  # no earlier context: the chunk's own keys, plain causal
            keys, values = k[start:end], v[start:end]
            mask = torch.ones(chunk.query_len, chunk.query_len, dtype=torch.bool, device=q.device).tril_()
        else:
            keys = k_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
            values = v_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
            mask = chunk.mask
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
