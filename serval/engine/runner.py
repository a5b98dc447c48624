"""Turns a SchedulerOutput into one forward pass over a flat token batch, then samples.

Owns the device side: the model and the preallocated KV cache tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serval.distributed import ParallelGroup
from serval.engine.cuda_graphs import DecodeBuckets, DecodeGraphs, copy_to_host
from serval.engine.request import Request
from serval.engine.scheduler import SchedulerOutput
from serval.engine.spec_decode import accept
from serval.layers.attention import AttentionMetadata, ScheduledSequence, new_kv_cache, select_backend
from serval.layers.sampler import (
    Sampler,
    SamplingRow,
    greedy_token_tensor,
    logprob_tensors,
    token_logprobs,
)
from serval.model.config import ModelConfig
from serval.outputs import TokenLogprobs
from serval.sampling_params import SamplingParams, takes_argmax_only

# Prompt logprobs take the logits of a chunk's positions this many float32 elements at a time (64 MiB), so a long
# chunk never holds a [chunk, vocab] tensor whole.
PROMPT_LOGITS_SLICE_ELEMENTS = 1 << 24


@dataclass
class ModelRunnerOutput:
    """What one step computed, by request id."""

    # Requests whose prompt is now fully computed: their new tokens (one; with guesses, the accepted ones and the
    # target's token after them), and those tokens' logprobs when asked for.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # For requests that ask for prompt logprobs: (index of the first prompt token scored, one entry per token).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class StepInputs:
    """One step's flat token batch and what to do with its rows after the forward."""

    input_ids: torch.Tensor | None = None  # [T]
    positions: torch.Tensor | None = None  # [T]
    meta: AttentionMetadata | None = None  # None when the step runs in a decode bucket (``seqs``)
    seqs: list[ScheduledSequence] = field(default_factory=list)  # the batch's sequences, in row order
    rows: dict[str, int] = field(default_factory=dict)  # each request's first row in the batch
    sampling_requests: list[Request] = field(default_factory=list)  # requests that sample this step
    guesses: list[list[int]] = field(default_factory=list)  # each one's guessed tokens (speculative decoding)
    logits_indices: list[int] = field(default_factory=list)  # the rows they sample from: 1 + len(guesses) each
    scored: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, first row, prompt tokens scored)


@dataclass
class LaunchedRun:
    """A multi-step run of decodes queued on the device, whose tokens the host has not read yet."""

    out: SchedulerOutput
    tokens: torch.Tensor  # [num_decode_steps, rows] on the host once ``ready`` (pinned on CUDA)
    ready: torch.cuda.Event | None = None  # recorded after the copies to the host (None: computed already)
    draw: RunDraw | None = None  # how sampled rows drew their tokens (None: every row its argmax)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # the draw's logprob tensors, on the host once ready


class RunDraw:
    """How a run of forwards (multi-step decoding) draws its rows' tokens on the device, ``done`` tokens after their
    outputs so far: the sampler over every row, each seeded one with its generator at its output position, as a step
    of its own would draw it, and the logprobs of the raw logits for the rows that ask for them, kept on the device
    until the run is read. Called once a forward, in order, by DecodeGraphs (a cuda_graphs.Draw) or
    ModelRunner._run_forwards."""

    def __init__(self, sampler: Sampler, device: torch.device, requests: list[Request], done: int = 0) -> None:
        self.sampler, self.device, self.requests, self.done = sampler, device, requests, done
        asked = [r.sampling_params.logprobs for r in requests if r.sampling_params.logprobs is not None]
        self.num_top = max(asked) if asked else None  # the most top logprobs a row asks for (None: no row asks)
        self._logprobs: list[tuple[torch.Tensor, ...]] = []  # each forward's logprob_tensors

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        raw = logits.float()
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids,
                            seeded_generator(r.sampling_params, len(r.output_token_ids) + self.done + step,
                                             self.device), [])
                for r in self.requests]
        tokens = self.sampler.sample_tensor(raw, rows)
        if self.num_top is not None:
            self._logprobs.append(logprob_tensors(raw, tokens, self.num_top))
        return tokens

    def logprob_tensors(self) -> list[torch.Tensor]:
        """The run's logprobs on the device: chosen and rank [steps, rows], top values and ids [steps, rows, N]."""
        return [torch.stack(part) for part in zip(*self._logprobs)]

    def token_logprobs(self, tokens: torch.Tensor, logprobs: list[torch.Tensor]) -> dict[str, list[TokenLogprobs]]:
        """Each asking request's logprobs, a token of the run each, from the run's ``tokens`` [steps, rows] and
        ``logprob_tensors`` (on the host), its top trimmed to what it asks for."""
        chosen, rank, top_values, top_ids = (part.tolist() for part in logprobs)
        steps = tokens.tolist()
        found = {}
        for i, request in enumerate(self.requests):
            num_top = request.sampling_params.logprobs
            if num_top is not None:
                found[request.request_id] = [
                    TokenLogprobs(row[i], chosen[s][i], rank[s][i], dict(zip(top_ids[s][i][:num_top],
                                                                              top_values[s][i][:num_top])))
                    for s, row in enumerate(steps)]
        return found


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of every layer's keys and values, in the cache's ``dtype`` (8-bit: codes and scales)."""
    row = new_kv_cache(1, 1, 1, 1, config.head_dim, dtype, "meta")[0, 0, 0, 0, 0]
    return config.num_layers * 2 * block_size * config.num_kv_heads * row.numel() * row.element_size()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, group: ParallelGroup | None = None,
                 decode_buckets: DecodeBuckets | None = None) -> None:
        """``decode_buckets``: run decode-only steps padded to batch-size buckets (cuda_graphs.py; on CUDA, replayed
        CUDA graphs), with one more KV cache block, past the scheduler's ``num_blocks``, for the padding rows."""
        cfg: ModelConfig = model.config  # a model-parallel rank's: its own KV heads or layers
        self.model = model
        # With several ranks, rank 0's runner sends each step's inputs to the others (``follow``) before its forward.
        self.group = group if group is not None and group.world_size > 1 else None
        self.device = torch.device(device)
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        # How attention runs, chosen once: the backend builds each step's metadata, which carries it to the layers.
        self.attention_backend = select_backend(self.device, dtype, block_size)
        # Model-parallel ranks run every step eagerly (their steps cross processes as pickled metadata). So does a
        # backend that gathers whole block tables: padded to max_model_len, every decode would read that many keys,
        # which costs more than the launches a graph saves (without capture it still pads when asked: the tests).
        if self.group is not None or (decode_buckets is not None and decode_buckets.capture
                                      and not self.attention_backend.table_width_is_free):
            decode_buckets = None
        # The one KV cache allocation: [layer, k/v, block, slot, kv head, row]. Steps never allocate more. ``dtype``
        # is the cache's: the model's, or an 8-bit code dtype (rows of codes and a scale: layers/attention/kv_rows.py).
        padding_blocks = 1 if decode_buckets is not None else 0
        self.kv_cache = new_kv_cache(cfg.num_layers, num_blocks + padding_blocks, block_size, cfg.num_kv_heads,
                                     cfg.head_dim, dtype, self.device)
        self.sampler = Sampler()
        self.decode_graphs = None
        if decode_buckets is not None:
            self.decode_graphs = DecodeGraphs(model, self.kv_cache, self.attention_backend, decode_buckets,
                                              pad_block=num_blocks)
        self.draft = None  # a DraftProposer with a cache of its own runs each step's batch after the model
        self._while_device_runs: Callable[[], None] | None = None  # execute's, until _collect calls it

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar_bitmasks: dict[str, torch.Tensor] | None = None,
                while_device_runs: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """Runs the step: samples for each request whose prompt is now fully computed (unless it asks for no
        tokens, max_tokens 0), and scores the prompt tokens of chunks whose request asks for prompt logprobs.
        ``grammar_bitmasks``: the tokens each constrained request may take, one row per position it samples.
        ``while_device_runs``: host work to do once the step's forward is queued and before the host waits for its
        tokens (on a GPU the two overlap); called at most once, and not at all by a step that samples nothing."""
        grammar_bitmasks = grammar_bitmasks or {}
        result = ModelRunnerOutput()
        self._while_device_runs = while_device_runs
        if out.num_decode_steps > 1:
            self._execute_decode_run(out, result)
            return result
        steps = [inputs for inputs in map(self.prepare_inputs, self._micro_batches(out)) if inputs is not None]
        if not steps:
            return result
        if self.group is not None:
            self.group.broadcast([(s.input_ids, s.positions, s.meta, self._logits_plan(s)) for s in steps])
        if steps[0].meta is None:  # a decode bucket's step (only ever alone: no pipeline here)
            inputs = steps[0]
            hiddens = [self.decode_graphs.run(inputs.seqs, inputs.input_ids, inputs.positions)]
        elif len(steps) == 1:
            hiddens = [self.model(steps[0].input_ids, steps[0].positions, self.kv_cache, steps[0].meta)]
        else:  # pipeline stages overlap: each micro-batch is scored while the next one is still in the stages
            hiddens = self.model.pipelined([(s.input_ids, s.positions, s.meta) for s in steps], self.kv_cache)
        for inputs, hidden in zip(steps, hiddens):
            if self.draft is not None:
                self.draft.mirror(inputs)
            self._collect(inputs, hidden, grammar_bitmasks, result)
        self._while_device_runs = None  # a step that sampled nothing leaves it to the caller
        return result

    def _micro_batches(self, out: SchedulerOutput) -> list[SchedulerOutput]:
        """A pipeline-parallel step's requests in one micro-batch per stage, of about equal tokens (other steps: the
        step itself). Each request's tokens stay in one micro-batch: its output does not depend on the split, since
        a request's rows never depend on the other rows of its batch."""
        if self.group is None or not hasattr(self.model, "pipelined") or len(out.scheduled) < 2:
            return [out]
        count = min(self.group.num_stages, len(out.scheduled))
        target = out.total_num_scheduled_tokens / count
        parts, done = [SchedulerOutput() for _ in range(count)], 0
        for i, request in enumerate(out.scheduled):
            # The next part once this one holds its share, keeping at least one request for each part left.
            index = min(int(done // target), count - 1, i)
            index = max(index, count - (len(out.scheduled) - i))
            part = parts[index]
            part.scheduled.append(request)
            tokens = out.num_scheduled_tokens[request.request_id]
            part.num_scheduled_tokens[request.request_id] = tokens
            if request.request_id in out.spec_token_ids:
                part.spec_token_ids[request.request_id] = out.spec_token_ids[request.request_id]
            done += tokens
        return parts

    def _collect(self, inputs: StepInputs, hidden: torch.Tensor, grammar_bitmasks: dict[str, torch.Tensor],
                 result: ModelRunnerOutput) -> None:
        """Scores the prompt tokens and samples the next tokens of one forward's requests, into ``result``."""
        for request, row, count in inputs.scored:
            first = request.num_computed_tokens + 1
            targets = request.prompt_token_ids[first: first + count]
            result.prompt_logprobs[request.request_id] = (
                first, self._score(hidden[row: row + count], targets, request.sampling_params.prompt_logprobs))
        if not inputs.sampling_requests:
            return
        # The indices ascend without repeats: as many as the rows means every row, in order (every decode-only step).
        if len(inputs.logits_indices) != hidden.shape[0]:
            hidden = hidden[self._tensor(inputs.logits_indices)]
        logits = self.model.compute_logits(hidden)
        if not grammar_bitmasks and all(self._takes_argmax_only(r) for r in inputs.sampling_requests):
            # Every row greedy with nothing to add (the usual batch): the sampler's tokens with no per-row objects.
            token_tensor = greedy_token_tensor(logits)
            self._host_work_while_device_runs()
            token_ids, logprobs = token_tensor.tolist(), []
        else:
            self._host_work_while_device_runs()
            # Row i of a request with guesses samples as if guesses[:i] had been accepted.
            rows = [self._sampling_row(request, guesses[:i], request.request_id in grammar_bitmasks)
                    for request, guesses in zip(inputs.sampling_requests, inputs.guesses)
                    for i in range(len(guesses) + 1)]
            sampler_output = self.sampler(logits, rows, self._allowed(inputs, grammar_bitmasks))
            token_ids, logprobs = sampler_output.token_ids, sampler_output.logprobs
        first = 0
        for request, guesses in zip(inputs.sampling_requests, inputs.guesses):
            sampled = token_ids[first: first + len(guesses) + 1]
            kept = accept(guesses, sampled)
            result.sampled_token_ids[request.request_id] = kept
            if request.sampling_params.logprobs is not None:
                result.logprobs[request.request_id] = logprobs[first: first + len(kept)]
            first += len(guesses) + 1

    def _execute_decode_run(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Multi-step decoding (``out.num_decode_steps`` forwards of decodes only, each row's token drawn from its
        logits alone): each forward's tokens are the next one's inputs without leaving the device, and the host reads
        them all once, at the end. Each forward is the plain decode step of the same rows (its bucket's graph, or
        eager) and the sampler's draw, each seeded row's generator at its output position, so the tokens are the
        ones as many steps would give (with the logprobs of their logits where asked for)."""
        run = self.launch_run(out)  # the buckets move the inputs on on the device
        if run is None:
            run = self._run_forwards(out)
        self._host_work_while_device_runs()  # the forwards are all queued: a GPU computes them meanwhile
        finished = self.finish_run(run)
        result.sampled_token_ids.update(finished.sampled_token_ids)
        result.logprobs.update(finished.logprobs)

    def _run_forwards(self, out: SchedulerOutput) -> LaunchedRun:
        """A multi-step run the buckets cannot take, queued a forward at a time: each forward's tokens are the next
        one's inputs, its metadata built by the host."""
        requests = out.scheduled
        starts = [r.num_computed_tokens for r in requests]
        token_ids = self._tensor([_last_token(r) for r in requests])
        start_positions = self._tensor(starts)
        graphs, draw = self.decode_graphs, self._draw(requests)
        sampled = []
        for step in range(out.num_decode_steps):
            seqs = [ScheduledSequence(r.block_ids, start + step, 1) for r, start in zip(requests, starts)]
            positions = start_positions + step
            if graphs is not None and graphs.accepts(seqs):
                hidden = graphs.run(seqs, token_ids, positions)
            else:
                meta = self.attention_backend.build_metadata(seqs)
                hidden = self.model(token_ids, positions, self.kv_cache, meta)
            logits = self.model.compute_logits(hidden)
            token_ids = greedy_token_tensor(logits) if draw is None else draw(logits, step)
            sampled.append(token_ids)
        return self._launched(out, torch.stack(sampled), draw)

    def _draw(self, requests: list[Request], done: int = 0) -> RunDraw | None:
        """How a run of ``requests`` draws its tokens, ``done`` tokens after their outputs so far: None where every
        row takes its argmax (the greedy forwards), else a RunDraw."""
        if all(self._takes_argmax_only(r) for r in requests):
            return None
        return RunDraw(self.sampler, self.device, requests, done)

    @staticmethod
    def _launched(out: SchedulerOutput, tokens: torch.Tensor, draw: RunDraw | None) -> LaunchedRun:
        """A run whose forwards are queued: its tokens [steps, rows] and the draw's logprobs, their copies to the host
        queued behind the forwards."""
        (tokens, *logprobs), ready = copy_to_host(tokens, *(draw.logprob_tensors() if draw is not None else []))
        return LaunchedRun(out, tokens, ready, draw, logprobs)

    # -- runs of decodes queued ahead (async scheduling) -------------------------------------------------------
    @torch.inference_mode()
    def launch_run(self, out: SchedulerOutput) -> LaunchedRun | None:
        """Queues a multi-step run (``out.num_decode_steps`` > 1) on the decode buckets, whose forwards move the
        inputs on on the device; None where they cannot take it (the caller then runs ``execute``)."""
        graphs = self.decode_graphs
        if out.num_decode_steps < 2 or graphs is None or not graphs.runs_in_a_row:
            return None
        requests = out.scheduled
        seqs = [ScheduledSequence(r.block_ids, r.num_computed_tokens, 1) for r in requests]
        if not graphs.accepts(seqs):
            return None
        draw = self._draw(requests)
        tokens = graphs.run_decodes(seqs, self._tensor([_last_token(r) for r in requests]),
                                    self._tensor([r.num_computed_tokens for r in requests]), out.num_decode_steps,
                                    draw)
        return self._launched(out, tokens, draw)

    @torch.inference_mode()
    def launch_next_run(self, previous: LaunchedRun, out: SchedulerOutput) -> LaunchedRun | None:
        """Queues the run ``out`` of the same requests, in the same order, right after ``previous`` and before its
        tokens are read: each request's inputs are where ``previous`` left them on the device, at its positions
        moved on by ``previous.out.num_decode_steps``. Waits for nothing. None where the buckets cannot take it."""
        graphs = self.decode_graphs
        moved_on = previous.out.num_decode_steps
        seqs = [ScheduledSequence(r.block_ids, r.num_computed_tokens + moved_on, 1) for r in out.scheduled]
        if not graphs.accepts(seqs):
            return None
        draw = self._draw(out.scheduled, done=moved_on)
        return self._launched(out, graphs.continue_decodes(seqs, out.num_decode_steps, draw), draw)

    def finish_run(self, run: LaunchedRun) -> ModelRunnerOutput:
        """Waits for a launched run's tokens: each request's, in order, and their logprobs where asked for."""
        if run.ready is not None:
            run.ready.synchronize()
        result = ModelRunnerOutput()
        for request, row in zip(run.out.scheduled, run.tokens.t().tolist()):
            result.sampled_token_ids[request.request_id] = row
        if run.logprobs:
            result.logprobs.update(run.draw.token_logprobs(run.tokens, run.logprobs))
        return result

    def _host_work_while_device_runs(self) -> None:
        work, self._while_device_runs = self._while_device_runs, None
        if work is not None:
            work()

    def _logits_plan(self, inputs: StepInputs) -> list[list[int]]:
        """The hidden rows of each compute_logits call ``execute`` makes for this step, in order: every rank makes
        the same calls, since a vocabulary-parallel head gathers across ranks."""
        rows = max(1, PROMPT_LOGITS_SLICE_ELEMENTS // self.vocab_size)
        plan = [list(range(row + i, row + min(i + rows, count)))
                for _, row, count in inputs.scored for i in range(0, count, rows)]
        return plan + ([inputs.logits_indices] if inputs.sampling_requests else [])

    @torch.inference_mode()
    def follow(self) -> None:
        """A model-parallel rank other than 0: runs rank 0's steps on this rank's shard (its part of every
        all-reduce and gather, or its pipeline stage) until rank 0 sends None."""
        while (steps := self.group.broadcast()) is not None:
            if len(steps) > 1:  # a pipeline stage's micro-batches (stage 0 gets each one's hidden states back)
                hiddens = self.model.pipelined([(ids, pos, meta) for ids, pos, meta, _ in steps], self.kv_cache)
            else:
                input_ids, positions, meta, _ = steps[0]
                hiddens = [self.model(input_ids, positions, self.kv_cache, meta)]
            for (*_, plan), hidden in zip(steps, hiddens):  # a stage 0 rank's part of each vocabulary gather
                for rows in plan:
                    self.model.compute_logits(hidden[self._tensor(rows)])

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs | None:
        """The flat batch of a step: decodes (one new token each) first, then prefill chunks; None if empty."""
        decodes = self._decode_only_inputs(out)
        if decodes is not None:
            return self._with_tensors(*decodes)
        counts = out.num_scheduled_tokens
        decodes = [r for r in out.scheduled if counts[r.request_id] == 1]
        prefills = [r for r in out.scheduled if counts[r.request_id] > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        inputs = StepInputs()
        for request in decodes + prefills:
            start = request.num_computed_tokens
            end = start + counts[request.request_id]
            inputs.rows[request.request_id] = len(input_ids)
            # Position i's logits score prompt token i + 1. Once a token was generated, the prompt's logprobs are
            # complete: a recompute after preemption does not score them again.
            num_scored = min(end, request.num_prompt_tokens - 1) - start
            if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids \
                    and num_scored > 0:
                inputs.scored.append((request, len(input_ids), num_scored))
            guesses = out.spec_token_ids.get(request.request_id, [])
            input_ids += request.token_ids_slice(start, end - len(guesses)) + guesses
            positions += range(start, end)
            if end - len(guesses) == request.num_tokens and request.max_tokens > 0:
                inputs.sampling_requests.append(request)
                inputs.guesses.append(guesses)
                inputs.logits_indices += range(len(input_ids) - len(guesses) - 1, len(input_ids))
        if not input_ids:
            return None
        inputs.seqs = [ScheduledSequence(r.block_ids, r.num_computed_tokens, counts[r.request_id])
                       for r in decodes + prefills]
        return self._with_tensors(inputs, input_ids, positions)

    @staticmethod
    def _decode_only_inputs(out: SchedulerOutput) -> tuple[StepInputs, list[int], list[int]] | None:
        """A step of decodes only, each sampling its next token (the usual step), without the per-request work of
        the general case: (its inputs but the tensors, its token ids, its positions). None for any other step."""
        requests, counts = out.scheduled, out.num_scheduled_tokens
        # One token each (no prefill chunk, no guesses), its last one, not computed yet: none is a one-token chunk of
        # its prompt, and none scores its prompt (position num_prompt_tokens - 1 scores no prompt token).
        if not requests or not all(counts[r.request_id] == 1 and r.num_computed_tokens + 1 == r.num_tokens
                                   and r.max_tokens > 0 for r in requests):
            return None
        input_ids = [_last_token(r) for r in requests]
        positions = [r.num_computed_tokens for r in requests]
        inputs = StepInputs(seqs=[ScheduledSequence(r.block_ids, p, 1) for r, p in zip(requests, positions)],
                            rows={r.request_id: i for i, r in enumerate(requests)}, sampling_requests=list(requests),
                            guesses=[[] for _ in requests], logits_indices=list(range(len(requests))))
        return inputs, input_ids, positions

    def _with_tensors(self, inputs: StepInputs, input_ids: list[int], positions: list[int]) -> StepInputs:
        """``inputs`` with its token ids and positions as tensors, and its attention metadata unless a decode bucket
        runs it."""
        if self.decode_graphs is not None and self.draft is None and self.decode_graphs.accepts(inputs.seqs):
            # The bucket copies them into its persistent buffers: built here on the CPU, one copy each.
            inputs.input_ids, inputs.positions = torch.tensor(input_ids), torch.tensor(positions)
            return inputs
        inputs.input_ids, inputs.positions = self._tensor(input_ids), self._tensor(positions)
        inputs.meta = self.attention_backend.build_metadata(inputs.seqs)
        return inputs

    def decode_metadata(self, block_tables: list[list[int]], positions: list[int]) -> AttentionMetadata:
        """Attention metadata of a batch of one-token decodes at ``positions`` (a draft model's guessing steps)."""
        return self.attention_backend.build_metadata(
            [ScheduledSequence(blocks, p, 1) for blocks, p in zip(block_tables, positions)])

    def _score(self, hidden: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
        """Logprobs of ``token_ids[i]`` under the logits of ``hidden[i]``, a bounded slice of rows at a time."""
        rows = max(1, PROMPT_LOGITS_SLICE_ELEMENTS // self.vocab_size)
        scores: list[TokenLogprobs] = []
        for i in range(0, len(token_ids), rows):
            logits = self.model.compute_logits(hidden[i: i + rows])
            scores += token_logprobs(logits, self._tensor(token_ids[i: i + rows]), num_top)
        return scores

    @staticmethod
    def _allowed(inputs: StepInputs, bitmasks: dict[str, torch.Tensor]) -> tuple[list[int], torch.Tensor] | None:
        """The constrained rows of the step's logits and their bitmasks, stacked in row order."""
        row_index, masks, first = [], [], 0
        for request, guesses in zip(inputs.sampling_requests, inputs.guesses):
            mask = bitmasks.get(request.request_id)
            if mask is not None:
                row_index += range(first, first + len(guesses) + 1)
                masks.append(mask)
            first += len(guesses) + 1
        return (row_index, torch.cat(masks)) if masks else None

    @staticmethod
    def _takes_argmax_only(request: Request) -> bool:
        """Whether ``request``'s rows this step are its logits' argmax: ``takes_argmax_only`` and past min_tokens, so
        that no id is blocked (with guesses too: they only lengthen its output)."""
        params = request.sampling_params
        return takes_argmax_only(params) and len(request.output_token_ids) >= params.min_tokens

    def _sampling_row(self, request: Request, guesses: list[int], constrained: bool = False) -> SamplingRow:
        """The sampler's view of ``request`` at its next output position, after ``guesses`` were accepted."""
        params = request.sampling_params
        outputs = request.output_token_ids + guesses if guesses else request.output_token_ids
        blocked: list[int] = []
        if len(outputs) < params.min_tokens and not constrained:  # a grammar decides when its output may end
            blocked = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else request.eos_token_ids))
        generator = seeded_generator(params, len(outputs), self.device)
        return SamplingRow(params, request.prompt_token_ids, outputs, generator, blocked)

    def _tensor(self, data: list) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)


def seeded_generator(params: SamplingParams, position: int, device: torch.device) -> torch.Generator | None:
    """A seeded sampled row's generator for its output token number ``position`` (None: not seeded, or greedy). A
    seeded draw depends only on the seed and the output position: the same token whether it is drawn in a plain
    decode step, while checking guesses or inside a run of forwards, whatever else shares the batch."""
    if params.seed is None or params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((params.seed * 1_000_003 + position) % (1 << 63))
    return generator


def _last_token(request: Request) -> int:
    """A decoding request's input: its last token, whose KV is not computed yet."""
    return request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
