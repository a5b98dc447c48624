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

Multi-step decoding (SchedulerConfig.num_scheduler_steps) runs several forwards of the same rows in a row
(``run_decodes``), each writing the next one's inputs in place: each real row's token at its next position, the
attention backend moving the metadata on (``advance_decodes``). Greedy rows run a bucket's greedy forward: the
forward, the logits, their argmax and those writes, captured as a second graph per bucket, so the host launches one
graph a forward and builds nothing in between. Sampled rows run the bucket's forward graph, then their logits and
the sampler's draw (a ``Draw``, the runner's) eagerly, then the same writes: still nothing for the host to wait on.
Either way the rows compute what ``run`` and the sampler give. With async scheduling, ``continue_decodes`` queues
the next run of the same rows behind it: their inputs are already in place, so it loads only the metadata (through
pinned memory, without waiting for the device).

Steps this does not take run eagerly as before: prefill chunks, guesses, batches over the largest bucket, a model
split over ranks (runner.group) and a draft model's steps.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serval.layers.attention import AttentionBackend, AttentionMetadata, ScheduledSequence
from serval.layers.linear import largest_row_padding
from serval.layers.sampler import greedy_token_tensor

logger = logging.getLogger(__name__)

# A run's draw for sampled rows: (the logits [rows, vocab] of its forward number i, i) -> their tokens [rows], on
# the device and only queued there (the runner's, through Sampler.sample_tensor).
Draw = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class DecodeBuckets:
    """Which padded decode steps a runner prepares: batches of up to ``max_num_seqs`` rows, each row's block table
    ``max_model_len`` tokens wide; ``capture``: record a CUDA graph per bucket (only on a CUDA device); ``multi_step``:
    runs of decodes (``run_decodes``), with each bucket's greedy forward (without it, start-up captures half the
    graphs)."""

    max_num_seqs: int
    max_model_len: int
    capture: bool = True
    multi_step: bool = True


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
        self.multi_step = buckets.multi_step
        device = kv_cache.device
        self.input_ids = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self._meta: dict[int, AttentionMetadata] = {}  # each bucket's persistent metadata
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # each graph's output: [bucket, hidden] states
        # Multi-step decoding: each bucket's greedy forward (run_decodes), its output tokens [bucket], and which rows
        # move on after a forward (1: a real row, 0: padding).
        self._greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._tokens: dict[int, torch.Tensor] = {}
        self.step = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self._run_rows = 0  # the real rows of the last run_decodes, which continue_decodes moves on
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
        meta, graph = self._load(seqs, input_ids, positions, self._graphs)
        if graph is None:
            hidden = self._forward(size, meta)
        else:
            graph.replay()
            hidden = self._hidden[size]
        return hidden[:num_rows]

    @property
    def runs_in_a_row(self) -> bool:
        """Whether ``run_decodes`` runs here, moving its forwards' inputs on without the host (the backend advances
        them)."""
        return self.multi_step and self.backend.advances_decodes

    @torch.inference_mode()
    def run_decodes(self, seqs: list[ScheduledSequence], input_ids: torch.Tensor, positions: torch.Tensor,
                    num_steps: int, draw: Draw | None = None) -> torch.Tensor:
        """Multi-step decoding: ``num_steps`` forwards of ``seqs`` (``accepts(seqs)``), each one's tokens (the argmax,
        or ``draw``'s for sampled rows) and next positions written into the persistent inputs on the device (for
        greedy rows on CUDA all of it one graph replay a forward). Returns the tokens [num_steps, len(seqs)] on the
        device. Each forward computes its real rows as ``run`` does, followed by the logits and tokens the runner
        takes after ``run``."""
        size, num_rows = self.bucket(len(seqs)), len(seqs)
        self._load_inputs(num_rows, size, input_ids, positions)
        meta, graph = self._load_metadata(seqs, self._greedy_graphs if draw is None else self._graphs)
        self.step[:num_rows].fill_(1)  # padding rows stay at token 0, position 0
        self.step[num_rows:size].zero_()
        self._run_rows = num_rows
        return self._forwards_in_a_row(size, num_rows, meta, graph, num_steps, draw)

    @torch.inference_mode()
    def continue_decodes(self, seqs: list[ScheduledSequence], num_steps: int, draw: Draw | None = None
                         ) -> torch.Tensor:
        """The run after the last ``run_decodes`` or ``continue_decodes``, of the same rows in the same order, queued
        before the host has read that run's tokens (async scheduling): its forwards left each row's next token and
        position in the persistent inputs, so only the metadata is loaded (``seqs`` at those positions; a table
        may have grown). Nothing here waits for the device. Returns the tokens [num_steps, len(seqs)]."""
        if len(seqs) != self._run_rows:
            raise ValueError(f"continue_decodes takes the last run's {self._run_rows} rows, got {len(seqs)}")
        meta, graph = self._load_metadata(seqs, self._greedy_graphs if draw is None else self._graphs)
        return self._forwards_in_a_row(self.bucket(len(seqs)), len(seqs), meta, graph, num_steps, draw)

    def _forwards_in_a_row(self, size: int, num_rows: int, meta: AttentionMetadata,
                           graph: torch.cuda.CUDAGraph | None, num_steps: int, draw: Draw | None) -> torch.Tensor:
        tokens = []
        for i in range(num_steps):
            if draw is not None:
                if graph is None:
                    hidden = self._forward(size, meta)
                else:
                    graph.replay()
                    hidden = self._hidden[size]
                step_tokens = draw(self.model.compute_logits(hidden[:num_rows]), i)
                self.input_ids[:num_rows].copy_(step_tokens)  # padding rows keep token 0
                self._move_on(size, meta)
            elif graph is None:
                step_tokens = self._greedy_forward(size, meta)
            else:
                graph.replay()
                step_tokens = self._tokens[size]
            tokens.append(step_tokens[:num_rows].clone())  # a replay overwrites the graph's output
        return torch.stack(tokens)

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)

    def _greedy_forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """One forward of the bucket's rows and its argmax tokens; then each real row's next inputs: that token at
        the next position (the metadata moved on by the backend)."""
        hidden = self._forward(size, meta)
        tokens = greedy_token_tensor(self.model.compute_logits(hidden))
        self.input_ids[:size].copy_(tokens * self.step[:size])
        self._move_on(size, meta)
        return tokens

    def _move_on(self, size: int, meta: AttentionMetadata) -> None:
        """Each real row's next position, and the metadata at it."""
        step = self.step[:size]
        self.positions[:size].add_(step)
        self.backend.advance_decodes(meta, step)

    def _load(self, seqs: list[ScheduledSequence], input_ids: torch.Tensor, positions: torch.Tensor,
              graphs: dict[int, torch.cuda.CUDAGraph]) -> tuple[AttentionMetadata, torch.cuda.CUDAGraph | None]:
        """Writes a step's token ids, positions and metadata into its bucket's persistent inputs. Returns the
        metadata to run with and the bucket's graph among ``graphs`` (None: run eagerly)."""
        self._load_inputs(len(seqs), self.bucket(len(seqs)), input_ids, positions)
        return self._load_metadata(seqs, graphs)

    def _load_inputs(self, num_rows: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.input_ids[num_rows:size].zero_()  # padding rows: token 0 at position 0
        self.positions[num_rows:size].zero_()

    def _load_metadata(self, seqs: list[ScheduledSequence], graphs: dict[int, torch.cuda.CUDAGraph]
                       ) -> tuple[AttentionMetadata, torch.cuda.CUDAGraph | None]:
        size, num_rows = self.bucket(len(seqs)), len(seqs)
        padded = seqs + [self.padding_row] * (size - num_rows)
        persistent = self._meta.get(size)
        if persistent is None:  # the bucket's first step makes its persistent metadata, tables max_blocks_per_seq wide
            meta = persistent = self._meta[size] = self.backend.build_metadata(padded, self.table_width)
        else:  # tables as wide as this step's widest (building max-width ones costs ms a step at 64 rows)
            meta = self.backend.build_metadata(padded)
        graph = graphs.get(size)
        if graph is not None and _plain_fields(meta) != _plain_fields(persistent):
            # A value the graph baked in at capture (an int, a list) differs: this step runs eagerly, on its own.
            logger.warning("decode bucket %d: metadata fields other than tensors changed since the capture; "
                           "running the step eagerly", size)
            return meta, None
        if persistent is not meta:
            _copy_metadata(meta, persistent, size)
        return persistent, graph

    def capture(self) -> None:
        """Records each bucket's forward, and (where the backend moves the inputs on) its greedy forward, the
        largest bucket first (the smaller ones reuse its pool's memory), over padding rows only, after one eager run
        of each."""
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.buckets):
                zeros = torch.zeros(size, dtype=torch.long)
                self.run([self.padding_row] * size, zeros, zeros)  # the warm-up: probes, lazy state
                if self.runs_in_a_row:
                    self.run_decodes([self.padding_row] * size, zeros, zeros, 1)
                    self.step.zero_()
                torch.cuda.synchronize(self.kv_cache.device)
                meta = self._meta[size]
                try:
                    self._graphs[size], self._hidden[size] = self._record(pool, self._forward, size, meta)
                    if self.runs_in_a_row:
                        self._greedy_graphs[size], self._tokens[size] = self._record(
                            pool, self._greedy_forward, size, meta)
                except RuntimeError as exc:  # a layer that synchronizes each call (e.g. a MoE's routing counts)
                    logger.warning("decode steps run eagerly: capturing the model in a CUDA graph failed (%s)", exc)
                    for graphs in (self._graphs, self._hidden, self._greedy_graphs, self._tokens):
                        graphs.clear()
                    return
        torch.cuda.synchronize(self.kv_cache.device)
        logger.info("captured decode CUDA graphs for batch sizes %s%s", self.buckets,
                    " (and their greedy forwards)" if self._greedy_graphs else "")

    @staticmethod
    def _record(pool, forward, size: int, meta: AttentionMetadata) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward(size, meta)
        return graph, output

    @property
    def captured(self) -> list[int]:
        """The buckets that replay a CUDA graph."""
        return sorted(self._graphs)


def copy_to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """The tensors' copies on the host, queued behind the device's work without waiting for it (on CUDA: into pinned
    memory, with one event to synchronize on before reading any; elsewhere the tensors themselves and None)."""
    if not tensors or tensors[0].device.type != "cuda":
        return list(tensors), None
    hosts = []
    for tensor in tensors:
        hosts.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
        hosts[-1].copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return hosts, ready


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
