"""Attention over a paged KV cache.

The flat token batch holds the decodes first (one query token each), then the prefill chunks.
Each layer writes its new keys and values into the cache slots named by ``slot_mapping``, then
attends: all decodes together in one batched call over their gathered blocks, each prefill
chunk on its own (there are few per step, and each is many tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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

    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        tables = meta.decode_block_tables
        # index_select, not k_cache[tables]: advanced indexing with a 2-D index is ~100x slower on CPU.
        shape = (tables.shape[0], tables.shape[1] * block_size, num_kv_heads, head_dim)
        keys = k_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)  # [D, KVH, L, D]
        values = v_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
        # One query per sequence: plain batched matmuls beat the flash kernel here 4-10x (it is built for long
        # queries). Query heads are grouped under their key/value head: [D, KVH, heads per KV head, dim].
        query = q[:num_decodes].view(num_decodes, num_kv_heads, -1, head_dim)
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [D, KVH, G, L]
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out[:num_decodes] = torch.matmul(probs, values).view(num_decodes, -1, head_dim)
    for chunk in meta.prefills:
        start, end = chunk.query_start, chunk.query_start + chunk.query_len
        query = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if chunk.mask is None:  # no earlier context: the chunk's own keys, plain causal
            keys, values = k[start:end], v[start:end]
        else:
            keys = k_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
            values = v_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                              scale=scale, enable_gqa=True)
        out[start:end] = attn.squeeze(0).transpose(0, 1)
    return out
