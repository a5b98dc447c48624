"""Decode steps padded to batch-size buckets on persistent input buffers; on CUDA, each bucket a captured graph.

A decode-only step (every scheduled sequence has exactly one new token: no prefill chunk, no speculative guesses)
runs its B rows padded to the smallest bucket that holds them (1, 2, 4, 8, ... and max_num_seqs; on CUDA starting
at the largest row count the model's linears pad to, e.g. 16, 32, ...). A padding row is a one-token sequence at
position 0 on the padding block: one KV cache block past the last one the KVCacheManager hands out, so a padding
row writes and reads no real sequence's keys. A bucket's persistent metadata has every block table
max_blocks_per_seq columns wide (``build_metadata``'s ``table_width``), so its inputs have the same shapes at every
step: each step copies its token ids, positions and metadata tensors in place into the bucket's persistent ones (its
tables as wide as its widest into their leading columns, the rest zeroed: a table_width build's content, without
building max-width tables in Python, which took 3.6 ms at 64 rows and 14 ms at 256).

On CUDA each bucket's forward is captured once at start-up and then replayed, which launches the step's ~1000
kernels at once instead of one by one from Python. Before its capture a bucket runs once eagerly: layers that probe
something on their first call (a linear's row padding) synchronize, which a capture forbids. The graphs share one
memory pool. Anywhere else the same code runs the persistent buffers eagerly (no capture), which is how the CPU suite
covers the padding. The graph ends at the hidden states; logits and sampling run after it, on the first B rows.

Steps this does not take run eagerly as before: prefill chunks, guesses, batches over the largest bucket, a model
split over ranks (runner.group) and a draft model's steps.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from serval.layers.attention import AttentionBackend, AttentionMetadata, ScheduledSequence
from serval.layers.linear import largest_row_padding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeBuckets:
    """Which padded decode steps a runner prepares: batches of up to ``max_num_seqs`` rows, each row's block table
    ``max_model_len`` tokens wide; ``capture``: record a CUDA graph per bucket (only on a CUDA device)."""

    max_num_seqs: int
    max_model_len: int
    capture: bool = True


def bucket_sizes(max_num_seqs: int, smallest: int = 1) -> list[int]:
    """``smallest``, twice it, four times it, ... below ``max_num_seqs``, then ``max_num_seqs`` itself, so that every
    batch it allows has one."""
    sizes, size = [], max(1, smallest)
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def model_bucket_sizes(model: torch.nn.Module, buckets: DecodeBuckets, device: torch.device) -> list[int]:
    """The buckets of ``model``'s decode steps. Captured on CUDA, none is smaller than the largest row count the
    model's linears pad to: a smaller one would cost as many rows, and each linear two more kernels (the pad and the
    slice) in the graph. Elsewhere from 1, so that the CPU suite covers every small bucket."""
    smallest = largest_row_padding(model) if buckets.capture and device.type == "cuda" else 1
    return bucket_sizes(buckets.max_num_seqs, smallest)


class DecodeGraphs:
    """The padded decode step of one runner: its buckets, their persistent inputs and (on CUDA) their graphs."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend,
                 buckets: DecodeBuckets, pad_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.buckets = model_bucket_sizes(model, buckets, kv_cache.device)
        self.table_width = -(-buckets.max_model_len // backend.block_size)  # max blocks a sequence holds
        self.padding_row = ScheduledSequence([pad_block], 0, 1)
        device = kv_cache.device
        self.input_ids = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self._meta: dict[int, AttentionMetadata] = {}  # each bucket's persistent metadata
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # each graph's output: [bucket, hidden] states
        if buckets.capture and device.type == "cuda":
            self.capture()

    def accepts(self, seqs: list[ScheduledSequence]) -> bool:
        """Whether a step over ``seqs`` runs here: all one-token decodes, few enough, tables narrow enough."""
        return (0 < len(seqs) <= self.buckets[-1]
                and all(s.num_new_tokens == 1 and len(s.block_ids) <= self.table_width for s in seqs))

    def bucket(self, num_rows: int) -> int:
        return next(size for size in self.buckets if size >= num_rows)

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSequence], input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The hidden states [len(seqs), hidden] of a decode step (``accepts(seqs)``; its token ids and positions
        [len(seqs)], on any device), computed over its bucket: the real rows first, padding rows after them."""
        size, num_rows = self.bucket(len(seqs)), len(seqs)
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.input_ids[num_rows:size].zero_()  # padding rows: token 0 at position 0
        self.positions[num_rows:size].zero_()
        padded = seqs + [self.padding_row] * (size - num_rows)
        persistent = self._meta.get(size)
        if persistent is None:  # the bucket's first step makes its persistent metadata, tables max_blocks_per_seq wide
            meta = persistent = self._meta[size] = self.backend.build_metadata(padded, self.table_width)
        else:  # tables as wide as this step's widest (building max-width ones costs ms a step at 64 rows)
            meta = self.backend.build_metadata(padded)
        graph = self._graphs.get(size)
        if graph is not None and _plain_fields(meta) != _plain_fields(persistent):
            # A value the graph baked in at capture (an int, a list) differs: this step runs eagerly, on its own.
            logger.warning("decode bucket %d: metadata fields other than tensors changed since the capture; "
                           "running the step eagerly", size)
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)[:num_rows]
        if persistent is not meta:
            _copy_metadata(meta, persistent, size)
        if graph is None:
            hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, persistent)
        else:
            graph.replay()
            hidden = self._hidden[size]
        return hidden[:num_rows]

    def capture(self) -> None:
        """Records each bucket's forward, the largest first (the smaller ones reuse its pool's memory), over padding
        rows only, after one eager run of it."""
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.buckets):
                zeros = torch.zeros(size, dtype=torch.long)
                self.run([self.padding_row] * size, zeros, zeros)  # the warm-up: probes, lazy state
                torch.cuda.synchronize(self.kv_cache.device)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache,
                                            self._meta[size])
                except RuntimeError as exc:  # a layer that synchronizes each call (e.g. a MoE's routing counts)
                    logger.warning("decode steps run eagerly: capturing the model in a CUDA graph failed (%s)", exc)
                    self._graphs.clear()
                    self._hidden.clear()
                    return
                self._graphs[size] = graph
                self._hidden[size] = hidden
        torch.cuda.synchronize(self.kv_cache.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    @property
    def captured(self) -> list[int]:
        """The buckets that replay a CUDA graph."""
        return sorted(self._graphs)


def _plain_fields(meta: AttentionMetadata) -> dict:
    """The metadata's compared fields that are not tensors (a graph's kernels were launched with their values)."""
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)
            if f.compare and not isinstance(getattr(meta, f.name), torch.Tensor)}


def _copy_metadata(meta: AttentionMetadata, persistent: AttentionMetadata, size: int) -> None:
    """Copies a step's metadata into its bucket's persistent one: tensors in place, plain values by assignment (a
    graph does not read them; an eager run does). A tensor narrower than the persistent one (a block table, or a mask
    over its keys) goes into its leading part and the rest is zeroed: block 0 and "not in context", which is what
    build_metadata's table_width pads with, so the result is what a table_width build gives."""
    for f in dataclasses.fields(meta):
        value, kept = getattr(meta, f.name), getattr(persistent, f.name)
        if not isinstance(kept, torch.Tensor):
            setattr(persistent, f.name, value)
        elif isinstance(value, torch.Tensor) and value.shape == kept.shape:
            kept.copy_(value, non_blocking=True)
        elif (isinstance(value, torch.Tensor) and value.dim() == kept.dim()
              and all(n <= m for n, m in zip(value.shape, kept.shape))):
            kept.zero_()
            kept[tuple(slice(0, n) for n in value.shape)].copy_(value, non_blocking=True)
        else:
            raise RuntimeError(f"decode bucket {size}: metadata {f.name} does not fit its persistent tensor")
