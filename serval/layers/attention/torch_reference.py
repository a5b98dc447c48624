"""Attention in PyTorch: the path on CUDA, and on a CPU where the C++ kernels cannot be built (or
SERVAL_CPU_KERNELS=0).

All decodes of a step attend together in one batched call over their gathered blocks, each prefill chunk on its own
(there are few per step, and each is many tokens). CPU and GPU matmul kernels sum in an order that depends on the
shapes, so decodes and prefills share one routine that does the arithmetic in float64: the products of 16- and
32-bit inputs are exact there and the sums so close to exact that the result no longer depends on the order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serval.layers.attention.base import AttentionBackend, AttentionMetadata, ScheduledSequence
from serval.layers.attention.kv_rows import gather_blocks, is_quantized, write_kv


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the flat batch
    query_len: int
    seq_len: int  # tokens of context after this chunk (cached + new)
    block_table: torch.Tensor  # [ceil(seq_len / block_size)] block ids
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None when the chunk is the whole sequence (plain causal)


@dataclass
class TorchReferenceMetadata(AttentionMetadata):
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks]
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool: key is in context
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchReferenceBackend(AttentionBackend):
    table_width_is_free = False  # a decode gathers its whole table, padding columns included

    def build_metadata(self, seqs: list[ScheduledSequence], table_width: int | None = None
                       ) -> TorchReferenceMetadata:
        num_decodes = next((i for i, s in enumerate(seqs) if s.num_new_tokens > 1), len(seqs))
        if any(s.num_new_tokens == 1 for s in seqs[num_decodes:]):
            raise ValueError("a step's one-token sequences come before its longer ones")
        meta = TorchReferenceMetadata(self, self.slot_mapping(seqs))
        if num_decodes:
            decodes = seqs[:num_decodes]
            tables = self._padded_tables(decodes, table_width)
            meta.num_decode_tokens = num_decodes
            meta.decode_block_tables = self._tensor(tables)
            key_pos = torch.arange(len(tables[0]) * self.block_size, device=self.device)
            positions = self._tensor([s.num_computed_tokens for s in decodes])
            meta.decode_mask = (key_pos[None, :] <= positions[:, None])[:, None, None, :]
        query_start = num_decodes
        for s in seqs[num_decodes:]:
            mask = None
            if s.num_computed_tokens > 0:  # earlier context in the cache: query i sees keys up to its own position
                q_pos = torch.arange(s.num_computed_tokens, s.end, device=self.device)
                mask = torch.arange(s.end, device=self.device)[None, :] <= q_pos[:, None]
            # A chunk reads its first seq_len keys only, so a padded table gives the same keys.
            table = self._tensor(self._padded_tables([s], table_width)[0] if table_width is not None
                                 else s.block_ids[: -(-s.end // self.block_size)])
            meta.prefills.append(PrefillChunk(query_start, s.num_new_tokens, s.end, table, mask))
            query_start += s.num_new_tokens
        return meta

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, k, slot_mapping)
        write_kv(v_cache, v, slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: TorchReferenceMetadata, scale: float, window: int | None,
               softcap: float | None = None) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], q.shape[2]
        out = torch.empty_like(q)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            tables = meta.decode_block_tables
            # index_select, not k_cache[tables]: advanced indexing with a 2-D index is ~100x slower on CPU.
            shape = (tables.shape[0], tables.shape[1] * block_size, num_kv_heads, head_dim)
            keys = gather_blocks(k_cache, tables.flatten()).view(shape).transpose(1, 2)  # [D, KVH, L, dim]
            values = gather_blocks(v_cache, tables.flatten()).view(shape).transpose(1, 2)
            # One query per sequence, its heads grouped under their key/value head: [D, KVH, heads per KV head, dim].
            query = q[:num_decodes].view(num_decodes, num_kv_heads, -1, head_dim)
            mask = meta.decode_mask
            if window:  # each decode's position is its number of keys in context, minus one
                positions = mask.sum(-1, keepdim=True) - 1
                mask = mask & (torch.arange(mask.shape[-1], device=q.device) > positions - window)
            attn = _attend(query, keys, values, mask, scale, softcap)
            out[:num_decodes] = attn.view(num_decodes, -1, head_dim)
        for chunk in meta.prefills:
            start, end = chunk.query_start, chunk.query_start + chunk.query_len
            if chunk.mask is None and not is_quantized(k_cache):  # no earlier context: the chunk's own keys, causal
                keys, values = k[start:end], v[start:end]
            else:  # (a quantized cache is always read back: decodes see the same values)
                keys = gather_blocks(k_cache, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
                values = gather_blocks(v_cache, chunk.block_table).flatten(0, 1)[: chunk.seq_len]
            mask = chunk.mask
            if mask is None:
                mask = torch.ones(chunk.query_len, chunk.query_len, dtype=torch.bool, device=q.device).tril_()
            if window:
                q_pos = torch.arange(chunk.seq_len - chunk.query_len, chunk.seq_len, device=q.device)
                mask = mask & (torch.arange(mask.shape[-1], device=q.device)[None, :] > q_pos[:, None] - window)
            # A chunk's queries as rows [KVH, Q * heads per KV head, dim] against keys [KVH, L, dim].
            q_len, group = chunk.query_len, q.shape[1] // num_kv_heads
            query = q[start:end].view(q_len, num_kv_heads, group, head_dim).transpose(0, 1).reshape(
                num_kv_heads, -1, head_dim)
            rows_mask = mask[:, None, :].expand(-1, group, -1).reshape(q_len * group, -1)
            attn = _attend(query, keys.transpose(0, 1), values.transpose(0, 1), rows_mask, scale, softcap)
            out[start:end] = attn.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(q_len, -1,
                                                                                                   head_dim)
        return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64, cast back to the query's dtype; with ``softcap``, the scores
    softcap * tanh(scores / softcap).

    query [..., M, dim], keys and values [..., L, dim], mask broadcastable to [..., M, L] (True: the key is in
    context)."""
    scores = torch.matmul(query.double(), keys.double().transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.double()).to(query.dtype)
