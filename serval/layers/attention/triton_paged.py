"""Attention on CUDA by one Triton kernel that reads the paged cache in place: every query token of a step, decode or
prefill chunk alike, in one launch.

One program per (query token, key/value head): its rows are the query heads that share that key/value head (GQA),
padded to 16 so ``tl.dot`` applies; it walks the token's context 0..pos in tiles of ``BLOCK_N`` keys at fixed
positions (each key's address from the block table), with an online softmax in float32. A query's arithmetic
depends only on its own position and keys: not on its batch-mates, the table width, or whether it came in a decode
or a chunk, since every launch uses the same tile size and the same order (the batch-invariance contract).
The grid and every argument depend only on tensor shapes, so a launch can be captured in a CUDA graph.

8-bit caches are not read here: the selector keeps the PyTorch reference for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from serval.layers.attention.base import AttentionBackend, AttentionMetadata, ScheduledSequence
from serval.layers.attention.kv_rows import is_quantized, write_kv

BLOCK_N = 64  # keys a tile: one constant for every launch, so a query's summation order never changes
MIN_ROWS = 16  # tl.dot's smallest M: a program's query heads are padded to at least this many rows
# Triton's CPU interpreter (the CPU tests) multiplies 16-bit floats in tl.dot wrongly, so there each dot's inputs are
# widened to float32 first: exact for bf16/fp16 values, so only the summation order differs from the GPU's MMA.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class TritonPagedMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # [S, W] int32 every scheduled sequence's block ids, padded with block 0
    query_seq: torch.Tensor  # [T] int32 each query token's row in block_tables
    query_pos: torch.Tensor  # [T] int32 each query token's position: it attends to keys 0..pos


class TritonPagedBackend(AttentionBackend):
    def build_metadata(self, seqs: list[ScheduledSequence], table_width: int | None = None) -> TritonPagedMetadata:
        """With ``table_width``, every table padded to that many columns (fixed shapes for CUDA-graph replay).

        Every tensor is built by numpy in one int32 host buffer (pinned on CUDA) and moved in one copy that does not
        wait: a table of 256 sequences x 512 blocks took ~10 ms from nested lists. The buffer holds
        [slot_mapping (int64, two words each) | block_tables | query_seq | query_pos]."""
        widest = max(len(s.block_ids) for s in seqs)
        if table_width is not None:
            if table_width < widest:
                raise ValueError(f"table_width {table_width} is narrower than a sequence's {widest} blocks")
            widest = table_width
        num_seqs = len(seqs)
        counts = np.fromiter((s.num_new_tokens for s in seqs), np.int64, num_seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
        num_tokens = int(counts.sum())
        table_end = 2 * num_tokens + num_seqs * widest
        host = torch.empty(table_end + 2 * num_tokens, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        words = host.numpy()
        table = words[2 * num_tokens:table_end].reshape(num_seqs, widest)
        table.fill(0)
        for row, s in enumerate(seqs):
            table[row, :len(s.block_ids)] = np.array(s.block_ids, np.int32)  # faster than from the list
        query_seq = words[table_end:table_end + num_tokens]
        query_pos = words[table_end + num_tokens:]
        query_seq[:] = np.repeat(np.arange(num_seqs), counts)
        first = np.cumsum(counts) - counts  # each sequence's first token in the flat batch
        query_pos[:] = np.arange(num_tokens) - np.repeat(first - starts, counts)
        bs = self.block_size
        words[:2 * num_tokens].view(np.int64)[:] = table[query_seq, query_pos // bs].astype(np.int64) * bs + \
            query_pos % bs
        moved = host.to(self.device, non_blocking=True)  # the same tensor on the CPU
        return TritonPagedMetadata(
            self, moved[:2 * num_tokens].view(torch.int64),
            block_tables=moved[2 * num_tokens:table_end].view(num_seqs, widest),
            query_seq=moved[table_end:table_end + num_tokens], query_pos=moved[table_end + num_tokens:])

    advances_decodes = True

    def advance_decodes(self, meta: TritonPagedMetadata, step: torch.Tensor) -> None:
        meta.query_pos.add_(step.to(meta.query_pos.dtype))
        meta.slot_mapping.copy_(self._slots(meta.block_tables, meta.query_seq, meta.query_pos, self.block_size))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Keys and values in one launch (two index_copy_ kernels in PyTorch: each launch counts at batch 1)."""
        if is_quantized(k_cache):  # the selector keeps 8-bit caches off this backend; PyTorch's rows if one comes
            write_kv(k_cache, k, slot_mapping)
            write_kv(v_cache, v, slot_mapping)
            return
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        _write_kv_kernel[(num_tokens,)](
            k_cache, v_cache, k, v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), num_kv_heads, BLOCK_SIZE=k_cache.shape[1],
            HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: TritonPagedMetadata, scale: float, window: int | None,
               softcap: float | None = None) -> torch.Tensor:
        if is_quantized(k_cache):
            raise ValueError("the Triton attention backend reads caches of the model's dtype, not 8-bit codes")
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        _paged_attention_kernel[(num_tokens, num_kv_heads)](
            out, q, k_cache, v_cache, meta.block_tables, meta.query_seq, meta.query_pos,
            *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), meta.block_tables.stride(0),
            scale, softcap or 0.0, window or 0,
            GROUP=group, ROWS=max(MIN_ROWS, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_N=BLOCK_N,
            USE_WINDOW=bool(window), USE_SOFTCAP=softcap is not None,
            # float32 inputs summed in float32 (not TF32), as the reference's float64 sums would round them
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDEN=INTERPRETED)
        return out


# The table's row stride is the only argument that changes with the batch (its width): not specialized on, so every
# width runs the one compiled kernel.
@triton.jit(do_not_specialize=["table_stride"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, query_seq_ptr, query_pos_ptr,
    q_stride_t, q_stride_h, q_stride_d, out_stride_t, out_stride_h, out_stride_d,
    k_stride_block, k_stride_slot, k_stride_head, k_stride_d,
    v_stride_block, v_stride_slot, v_stride_head, v_stride_d, table_stride,
    scale, softcap, window,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(query_seq_ptr + token)
    pos = tl.load(query_pos_ptr + token)

    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :] * q_stride_d,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)

    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)

    lo = 0
    if USE_WINDOW:  # the first tile that holds a key in the window; tiles stay at multiples of BLOCK_N
        lo = tl.maximum(pos - window + 1, 0) // BLOCK_N * BLOCK_N
    table_row = tables_ptr + seq.to(tl.int64) * table_stride
    for start in range(lo, pos + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_context = keys <= pos
        if USE_WINDOW:
            in_context = in_context & (keys > pos - window)
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        load_ok = in_context[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * k_stride_block + slot[:, None] * k_stride_slot
                    + kv_head * k_stride_head + dims[None, :] * k_stride_d, mask=load_ok, other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [ROWS, BLOCK_N] float32
        if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (stable at both ends)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # finite: every tile holds a key in context
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(row_max - new_max)
        row_sum = row_sum * correction + tl.sum(probs, 1)
        v = tl.load(v_cache_ptr + block[:, None] * v_stride_block + slot[:, None] * v_stride_slot
                    + kv_head * v_stride_head + dims[None, :] * v_stride_d, mask=load_ok, other=0.0)
        weights = probs.to(v.dtype)  # rounded to the cache's dtype for the MMA
        if WIDEN:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * correction[:, None] + tl.dot(weights, v, input_precision=DOT_PRECISION)
        row_max = new_max

    result = acc / row_sum[:, None]
    tl.store(out_ptr + token * out_stride_t + heads[:, None] * out_stride_h + dims[None, :] * out_stride_d,
             result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_mapping_ptr, k_stride_t, k_stride_h, v_stride_t,
                     v_stride_h, kc_stride_block, kc_stride_slot, kc_stride_head, vc_stride_block, vc_stride_slot,
                     vc_stride_head, num_kv_heads, BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """One token's keys and values [KVH, D] (each head's values contiguous) into its cache slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    ok = (heads < num_kv_heads) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=ok)
    v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=ok)
    tl.store(k_cache_ptr + block * kc_stride_block + offset * kc_stride_slot + heads * kc_stride_head + dims, k,
             mask=ok)
    tl.store(v_cache_ptr + block * vc_stride_block + offset * vc_stride_slot + heads * vc_stride_head + dims, v,
             mask=ok)
