"""Decode steps padded to batch-size buckets (engine/cuda_graphs.py): on the CPU the same padded step code runs
without capture (EngineConfig.pad_decode_on_cpu), so these tests cover the padding, the padding block and the
persistent buffers; the GPU tests at the end check the captured graphs' replay."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from real_model import MODEL_PATH, requires_model
from tiny_models import tiny_llama

from serval import SamplingParams
from serval.cli import _engine_config, build_parser
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.engine.cuda_graphs import DecodeBuckets, DecodeGraphs, bucket_sizes, model_bucket_sizes
from serval.engine.messages import EngineCoreRequest
from serval.engine.runner import ModelRunner, seeded_generator
from serval.layers.attention import ScheduledSequence
from serval.layers.attention.torch_reference import TorchReferenceBackend
from serval.layers.linear import largest_row_padding
from serval.layers.sampler import SamplingRow
from serval.model.loader import load_model

BLOCK = 16
NUM_BLOCKS = 96
MAX_MODEL_LEN = 128  # 8 blocks a table


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama as the engine loads it, in bfloat16 (the dtype whose GEMMs vary most with the row count)."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=1).save_pretrained(path, safe_serialization=True)
    return path, load_model(path, torch.bfloat16)


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_captured_buckets_start_at_the_largest_row_padding_of_the_models_linears(tiny):
    """On CUDA a bucket below the linears' row padding would cost as many rows plus a pad per linear: the smallest
    bucket is the largest padding (no CUDA device needed: the sizes come from the probed paddings); on the CPU, and
    without capture, every small bucket stays, as the CPU suite covers them."""
    _, model = tiny
    assert bucket_sizes(256, 16) == [16, 32, 64, 128, 256]
    assert bucket_sizes(48, 64) == [48]
    linears = [m for m in model.modules() if isinstance(getattr(m, "min_rows", None), int)]
    saved = [m.min_rows for m in linears]
    try:
        for m in linears:
            m.min_rows = 16
        linears[3].min_rows = 64
        assert largest_row_padding(model) == 64
        cuda, cpu = torch.device("cuda"), torch.device("cpu")
        assert model_bucket_sizes(model, DecodeBuckets(256, MAX_MODEL_LEN), cuda) == [64, 128, 256]
        assert model_bucket_sizes(model, DecodeBuckets(48, MAX_MODEL_LEN), cuda) == [48]
        assert model_bucket_sizes(model, DecodeBuckets(16, MAX_MODEL_LEN), cpu) == [1, 2, 4, 8, 16]
        assert model_bucket_sizes(model, DecodeBuckets(16, MAX_MODEL_LEN, capture=False), cuda) == [1, 2, 4, 8, 16]
    finally:
        for m, min_rows in zip(linears, saved):
            m.min_rows = min_rows


PATHS = ["cpu_kernel", "float64", "triton"]


def _runner(model, path: str) -> ModelRunner:
    """A CPU runner that pads decodes, over attention by ``path``: the C++ kernel (as selected here), the PyTorch
    reference, or the Triton kernel under Triton's CPU interpreter (the CUDA backend; tests/conftest.py sets it)."""
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK, torch.bfloat16, "cpu",
                         decode_buckets=DecodeBuckets(max_num_seqs=16, max_model_len=MAX_MODEL_LEN, capture=False))
    if path == "float64":
        runner.attention_backend = runner.decode_graphs.backend = TorchReferenceBackend("cpu", torch.bfloat16, BLOCK)
    elif path == "triton":
        triton_paged = pytest.importorskip("serval.layers.attention.triton_paged")
        runner.attention_backend = runner.decode_graphs.backend = triton_paged.TritonPagedBackend(
            "cpu", torch.bfloat16, BLOCK)
    return runner


def _decodes(runner: ModelRunner, num_rows: int) -> tuple[list[ScheduledSequence], torch.Tensor, torch.Tensor]:
    """``num_rows`` sequences of different lengths (1 to 5 blocks each, none shared), their histories prefilled
    into the cache eagerly, each now decoding one token."""
    gen = torch.Generator().manual_seed(num_rows)
    seqs, ids = [], []
    for i in range(num_rows):
        length = 3 + 11 * i % 70
        blocks = list(range(1 + 5 * i, 2 + 5 * i + length // BLOCK))  # each its own
        history = torch.randint(0, 256, (length + 1,), generator=gen)
        prefill = [ScheduledSequence(blocks, 0, length)]
        runner.model(history[:length], torch.arange(length), runner.kv_cache,
                     runner.attention_backend.build_metadata(prefill))
        seqs.append(ScheduledSequence(blocks, length, 1))
        ids.append(int(history[length]))
    return seqs, torch.tensor(ids), torch.tensor([s.num_computed_tokens for s in seqs])


@pytest.mark.parametrize("path", PATHS)
@torch.inference_mode()
def test_the_padded_bucket_step_equals_the_eager_step_bitwise(tiny, path):
    """B rows padded to their bucket (1 -> 1, 3 -> 4, 5 -> 8, 16 -> 16) give bitwise the eager step's hidden states
    and write bitwise the same keys and values; padding rows touch only the padding block, even when it holds NaN.
    The bucket's first step makes its persistent metadata; later ones, narrower tables included, are copied into it
    and leave it as a table_width build of the step would be."""
    _, model = tiny
    for num_rows, bucket in [(1, 1), (3, 4), (5, 8), (16, 16)]:
        runner = _runner(model, path)
        graphs = runner.decode_graphs
        assert graphs.bucket(num_rows) == bucket and runner.kv_cache.shape[2] == NUM_BLOCKS + 1
        seqs, ids, _ = _decodes(runner, num_rows)
        assert graphs.accepts(seqs)
        runner.kv_cache[:, :, NUM_BLOCKS] = float("nan")  # the padding block: garbage must not reach a real row
        # The same step twice (made, then copied in place), then each sequence back in its first block (narrower).
        short = [ScheduledSequence(s.block_ids[:1], s.num_computed_tokens % BLOCK, 1) for s in seqs]
        for step in (seqs, seqs, short):
            step_positions = torch.tensor([s.num_computed_tokens for s in step])
            before = runner.kv_cache.clone()
            eager = model(ids, step_positions, runner.kv_cache, runner.attention_backend.build_metadata(step))
            eager_cache = runner.kv_cache.clone()
            runner.kv_cache.copy_(before)
            padded = graphs.run(step, ids, step_positions)
            assert padded.shape == eager.shape and torch.equal(padded, eager), (path, num_rows)
            assert torch.equal(runner.kv_cache[:, :, :NUM_BLOCKS], eager_cache[:, :, :NUM_BLOCKS])
            wide = runner.attention_backend.build_metadata(step + [graphs.padding_row] * (bucket - num_rows),
                                                           graphs.table_width)
            kept = graphs._meta[bucket]
            assert len(graphs._meta) == 1 and all(
                torch.equal(getattr(kept, f.name), getattr(wide, f.name)) for f in dataclasses.fields(wide)
                if isinstance(getattr(wide, f.name), torch.Tensor))


class _FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@torch.inference_mode()
def test_a_captured_bucket_replays_unless_its_plain_metadata_changed(tiny):
    """The dispatch around a captured graph, on the CPU with a stand-in graph: a step of a captured bucket copies its
    inputs in place and replays, returning the graph's output rows; if a plain (non-tensor) metadata value differs
    from the one the graph was captured with, the step runs eagerly on its own metadata instead."""
    _, model = tiny
    runner = _runner(model, "float64")
    graphs = runner.decode_graphs
    seqs, ids, positions = _decodes(runner, 3)
    eager = graphs.run(seqs, ids, positions).clone()  # makes bucket 4's persistent inputs
    fake, output = _FakeGraph(), torch.randn(4, eager.shape[1]).to(eager.dtype)
    graphs._graphs[4], graphs._hidden[4] = fake, output
    assert torch.equal(graphs.run(seqs, ids, positions), output[:3]) and fake.replays == 1
    assert torch.equal(graphs.input_ids[:4], torch.tensor([*ids.tolist(), 0]))
    graphs._meta[4].num_decode_tokens = 99  # as if the graph had baked in another value
    assert torch.equal(graphs.run(seqs, ids, positions), eager) and fake.replays == 1


def test_steps_the_buckets_do_not_take():
    """Prefill chunks, decodes with guesses (more than one new token), batches past the largest bucket and tables
    wider than max_model_len's run eagerly."""
    graphs = DecodeGraphs(torch.nn.Identity(), torch.zeros(1, 2, 9, BLOCK, 1, 1), TorchReferenceBackend(
        "cpu", torch.float32, BLOCK), DecodeBuckets(max_num_seqs=4, max_model_len=64), pad_block=8)
    one = ScheduledSequence([0, 1], 20, 1)
    assert graphs.accepts([one] * 4)
    assert not graphs.accepts([one] * 5)
    assert not graphs.accepts([one, ScheduledSequence([2], 3, 2)])
    assert not graphs.accepts([ScheduledSequence(list(range(5)), 70, 1)])
    assert not graphs.accepts([])


def _core(path, model, **config) -> EngineCore:
    config.setdefault("speculative", SpeculativeConfig(method=None))
    return EngineCore(EngineConfig(dtype="bfloat16", max_model_len=MAX_MODEL_LEN, **config), path, model)


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int,
            stop_token_ids: list[int] | None = None) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_token_ids or [])
    return _tokens(core, prompts, [params] * len(prompts))


def _tokens(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
            logprobs: dict[str, list] | None = None) -> dict[str, list[int]]:
    """Each request's tokens, run to the end on ``core``; request i is "ri", with prompt i and params i. ``logprobs``,
    if given, gets each asking request's token logprobs."""
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, request_params, [], request_params.max_tokens))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if logprobs is not None and out.new_logprobs:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
    return tokens


def _count_bucket_steps(core: EngineCore) -> list[int]:
    graphs, rows = core.runner.decode_graphs, []
    run = graphs.run
    graphs.run = lambda seqs, ids, positions: rows.append(len(seqs)) or run(seqs, ids, positions)
    return rows


@pytest.mark.parametrize("num_blocks", [64, 10])  # 10: too few for all five at once, so requests are preempted
def test_greedy_output_through_the_engine_is_the_same_with_padded_decode(tiny, num_blocks):
    """Five concurrent greedy requests of different prompt lengths (and, with a small cache, preemption and
    recompute; with a shared prefix, prefix-cache hits) give the same tokens with the padded decode path as eagerly,
    and every decode step but the ones beside a prefill went through a bucket."""
    path, model = tiny
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 30, 9, 21)]
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks)
    scheduler = SchedulerConfig(max_num_seqs=8)
    eager_core = _core(path, model, cache=cache, scheduler=scheduler)
    eager = _greedy(eager_core, prompts[2:3], 24), _greedy(eager_core, prompts, 24)
    core = _core(path, model, cache=cache, scheduler=scheduler, pad_decode_on_cpu=True)
    rows = _count_bucket_steps(core)
    # The 30-token prompt alone first: then the others that share its first block find it cached.
    assert (_greedy(core, prompts[2:3], 24), _greedy(core, prompts, 24)) == eager
    assert len(rows) > 15 and max(rows) > 2
    assert core.stats.num_preemptions > 0 if num_blocks == 10 else core.stats.prefix_cache_hit_tokens > 0


def test_a_backend_that_gathers_whole_tables_captures_no_graphs(tiny, monkeypatch):
    """The PyTorch reference reads every column of a padded table: a runner that would capture graphs over it (on
    CUDA) runs its decodes eagerly instead, with no padding block; without capture it pads (how these tests run it)."""
    _, model = tiny
    assert not TorchReferenceBackend.table_width_is_free
    monkeypatch.setattr("serval.engine.runner.select_backend", TorchReferenceBackend)
    captured = ModelRunner(model, NUM_BLOCKS, BLOCK, torch.bfloat16, "cpu", decode_buckets=DecodeBuckets(4, 64))
    padded = ModelRunner(model, NUM_BLOCKS, BLOCK, torch.bfloat16, "cpu",
                         decode_buckets=DecodeBuckets(4, 64, capture=False))
    assert isinstance(captured.attention_backend, TorchReferenceBackend)
    assert captured.decode_graphs is None and captured.kv_cache.shape[2] == NUM_BLOCKS
    assert padded.decode_graphs is not None and padded.kv_cache.shape[2] == NUM_BLOCKS + 1


def test_enforce_eager_parses_and_turns_the_padded_path_off(tiny):
    assert _engine_config(build_parser().parse_args(["serve"])).enforce_eager is EngineConfig.enforce_eager is False
    assert _engine_config(build_parser().parse_args(["serve", "--enforce-eager"])).enforce_eager is True
    path, model = tiny
    cache = CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert _core(path, model, cache=cache, pad_decode_on_cpu=True).runner.decode_graphs is not None
    core = _core(path, model, cache=cache, pad_decode_on_cpu=True, enforce_eager=True)
    assert core.runner.decode_graphs is None and core.runner.kv_cache.shape[2] == NUM_BLOCKS  # no padding block
    assert _core(path, model, cache=cache).runner.decode_graphs is None  # a CPU runs eagerly unless asked


@requires_model
def test_the_embedded_model_greedy_is_the_same_with_padded_decode(smollm):
    model, _ = smollm("bfloat16")
    prompts = [[1, 504, 3458, 2632, 282, 9147, 314], [1, 1670, 28265, 30, 94, 42], [1, 11110, 2402, 253, 655]]
    cache = CacheConfig(num_blocks=64)
    eager = _greedy(_core(MODEL_PATH, model, cache=cache), prompts, 8)
    core = _core(MODEL_PATH, model, cache=cache, pad_decode_on_cpu=True)
    rows = _count_bucket_steps(core)
    assert _greedy(core, prompts, 8) == eager and rows


# --- on a GPU: the captured graphs ---------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_core(model=None, **config) -> EngineCore:
    """The embedded model on CUDA in bfloat16 (``model``: already loaded, shared), buckets up to 64 rows."""
    config.setdefault("speculative", SpeculativeConfig(method=None))
    config.setdefault("cache", CacheConfig(num_blocks=512))
    config.setdefault("scheduler", SchedulerConfig(max_num_seqs=64))
    core = EngineCore(EngineConfig(dtype="bfloat16", device="cuda", max_model_len=1024, **config), MODEL_PATH, model)
    if not config.get("enforce_eager") and not core.runner.attention_backend.table_width_is_free:
        core.shutdown()
        pytest.skip("the CUDA attention backend gathers whole block tables (the PyTorch reference): no graphs")
    return core


@pytest.mark.gpu
@requires_model
@needs_cuda
@torch.inference_mode()
def test_graph_replay_equals_eager_for_every_bucket():
    """Each bucket's replayed graph gives bitwise the hidden states of the same padded step run eagerly, and the
    unpadded eager step's greedy tokens; prints the replayed and eager step times at 1 and 64 rows."""
    core = _cuda_core()
    runner, graphs = core.runner, core.runner.decode_graphs
    assert graphs.captured == bucket_sizes(64, largest_row_padding(runner.model))
    uncaptured = _uncaptured(runner)
    for bucket, num_rows, seqs, ids, positions in _random_batches(graphs.buckets, 0, 95):
        replayed = graphs.run(seqs, ids, positions).clone()
        assert torch.equal(replayed, uncaptured.run(seqs, ids, positions)), (bucket, num_rows)
        eager = _eager_step(runner, seqs, ids, positions)
        assert torch.equal(runner.model.compute_logits(replayed).argmax(-1),
                           runner.model.compute_logits(eager).argmax(-1)), (bucket, num_rows)
    for num_rows in (1, 64):
        seqs = [ScheduledSequence(list(range(i * 6, i * 6 + 6)), 80, 1) for i in range(num_rows)]
        ids, positions = torch.zeros(num_rows, dtype=torch.long), torch.full((num_rows,), 80)
        replayed = _step_time(graphs.run, seqs, ids, positions)
        eager = _step_time(_eager_step, runner, seqs, ids, positions)
        print(f"decode step at {num_rows} rows: replayed {replayed * 1e3:.2f} ms, eager {eager * 1e3:.2f} ms "
              f"({torch.cuda.get_device_name()})")
    core.shutdown()


@pytest.mark.gpu
@requires_model
@needs_cuda
@torch.inference_mode()
def test_runs_of_forwards_equal_one_step_at_a_time_for_every_bucket():
    """Multi-step decoding on each bucket (full and half full), 3 forwards in a row: greedy (the greedy graphs) and
    seeded draws (the forward graphs and the sampler's draw) each give the tokens of the same forwards run eagerly on
    the persistent inputs, and of 3 plain decode steps, each fed the last one's token at the next position."""
    core = _cuda_core()
    runner, graphs = core.runner, core.runner.decode_graphs
    assert graphs.runs_in_a_row and sorted(graphs._greedy_graphs) == graphs.captured
    uncaptured = _uncaptured(runner)
    for bucket, num_rows, seqs, ids, positions in _random_batches(graphs.buckets, 1, 90):
        for draw in (None, _seeded_draw(runner, num_rows)):
            replayed = graphs.run_decodes(seqs, ids, positions, 3, draw).cpu()
            assert torch.equal(replayed, uncaptured.run_decodes(seqs, ids, positions, 3, draw).cpu()), \
                (bucket, num_rows, draw)
            tokens, stepped = ids, []
            for step in range(3):
                step_seqs = [ScheduledSequence(s.block_ids, s.num_computed_tokens + step, 1) for s in seqs]
                logits = runner.model.compute_logits(graphs.run(step_seqs, tokens, positions + step))
                tokens = logits.float().argmax(-1) if draw is None else draw(logits, step)
                stepped.append(tokens.cpu())
            assert torch.equal(replayed, torch.stack(stepped)), (bucket, num_rows, draw)
    core.shutdown()


def _seeded_draw(runner: ModelRunner, num_rows: int):
    """A run's draw for ``num_rows`` seeded rows (temperature, top-k and top-p), each row at its own output positions:
    the runner's generators and sampler, as ModelRunner._draw makes it."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)

    def draw(logits: torch.Tensor, step: int) -> torch.Tensor:
        rows = [SamplingRow(params, [], [], seeded_generator(params, 100 * i + step, runner.device), [])
                for i in range(num_rows)]
        return runner.sampler.sample_tensor(logits, rows)

    return draw


def _uncaptured(runner: ModelRunner) -> DecodeGraphs:
    """The runner's padded decode step without graphs (eager on the same persistent-buffer code)."""
    return DecodeGraphs(runner.model, runner.kv_cache, runner.attention_backend,
                        DecodeBuckets(64, 1024, capture=False), runner.kv_cache.shape[2] - 1)


def _random_batches(buckets: list[int], seed: int, max_position: int):
    """For each bucket a full and a just-over-half-full batch of decodes: (bucket, rows, sequences of 6 blocks each at
    random positions below ``max_position``, random token ids, their positions)."""
    gen = torch.Generator().manual_seed(seed)
    for bucket in buckets:
        for num_rows in sorted({bucket, max(1, bucket // 2 + 1)}):
            seqs = [ScheduledSequence(list(range(i * 6, i * 6 + 6)), int(p), 1)
                    for i, p in enumerate(torch.randint(0, max_position, (num_rows,), generator=gen))]
            ids = torch.randint(0, 49152, (num_rows,), generator=gen)
            yield bucket, num_rows, seqs, ids, torch.tensor([s.num_computed_tokens for s in seqs])


def _eager_step(runner: ModelRunner, seqs: list[ScheduledSequence], ids: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    return runner.model(ids.cuda(), positions.cuda(), runner.kv_cache, runner.attention_backend.build_metadata(seqs))


def _step_time(step, *args, repeats: int = 20) -> float:
    for _ in range(3):
        step(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


@pytest.mark.gpu
@requires_model
@needs_cuda
def test_cuda_graphs_keep_greedy_output_through_preemption_and_prefix_hits():
    """On CUDA, greedy tokens with the graphs equal --enforce-eager's: with a cache small enough to preempt, and with
    prompts sharing a long prefix (prefix-cache hits)."""
    shared = list(range(1000, 1040))
    prompts = [shared + [7 + i] * (i + 1) for i in range(6)] + [list(range(2000, 2000 + n)) for n in (3, 50, 90)]
    model = None
    for cache in (CacheConfig(num_blocks=24), CacheConfig(num_blocks=512)):
        cores = {}
        for eager in (True, False):
            cores[eager] = _cuda_core(model, cache=cache, enforce_eager=eager)
            model = cores[eager].model
        assert cores[True].runner.decode_graphs is None and cores[False].runner.decode_graphs.captured
        # The first prompt alone, then all: the others find the shared prefix cached.
        outputs = {eager: (_greedy(core, prompts[:1], 40), _greedy(core, prompts, 40)) for eager, core in cores.items()}
        assert outputs[False] == outputs[True]
        stats = cores[False].stats
        print(f"num_blocks {cache.num_blocks}: preemptions {stats.num_preemptions}, prefix-cache hit tokens "
              f"{stats.prefix_cache_hit_tokens}")
        assert stats.num_preemptions > 0 if cache.num_blocks == 24 else stats.prefix_cache_hit_tokens > 0
        for core in cores.values():
            core.shutdown()


@pytest.mark.gpu
@requires_model
@needs_cuda
def test_async_scheduling_on_cuda_keeps_greedy_output_through_stops_preemption_and_prefix_hits():
    """On CUDA with multi-step runs queued ahead (--async-scheduling), greedy tokens equal the runs read one at a
    time: with stop tokens met inside runs, a cache small enough to preempt, and prompts sharing a prefix."""
    shared = list(range(1000, 1040))
    prompts = [shared + [7 + i] * (i + 1) for i in range(6)] + [list(range(2000, 2000 + n)) for n in (3, 50, 90)]
    model = None
    for cache in (CacheConfig(num_blocks=24), CacheConfig(num_blocks=512)):
        cores = {}
        for queued in (False, True):
            cores[queued] = _cuda_core(model, cache=cache,
                                       scheduler=SchedulerConfig(max_num_seqs=64, async_scheduling=queued))
            model = cores[queued].model
        free = _greedy(cores[False], prompts[:3], 40)
        stops = [tokens[13] for tokens in free.values()]  # inside the second run of 8 of those requests
        launches = _record_queued_runs(cores[True])
        outputs = {queued: (_greedy(core, prompts[:1], 40), _greedy(core, prompts, 40, stops))
                   for queued, core in cores.items()}
        assert outputs[True] == outputs[False]
        assert any(len(tokens) < 40 for tokens in outputs[True][1].values())  # some stopped inside a run
        assert any(run is not None for run in launches)
        for core in cores.values():
            assert core.kv_cache.pool.num_owned_blocks() == 0
            core.shutdown()


@pytest.mark.gpu
@requires_model
@needs_cuda
def test_seeded_sampled_requests_on_cuda_draw_in_runs_what_one_forward_a_step_draws():
    """On CUDA, seeded sampled requests (temperature, top-k, top-p, min-p) beside greedy ones, some asking for logprobs,
    get the same tokens with multi-step runs (the default 8 forwards, the sampler's draws fed back on the device), with
    those runs queued ahead (--async-scheduling), and one forward a step; their logprobs agree within 1e-4 and
    their top ids exactly."""
    prompts = [list(range(1000 + 50 * i, 1010 + 50 * i + 3 * i)) for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02 * (i % 2), seed=i, max_tokens=40,
                             ignore_eos=True, logprobs=2 if i % 3 == 0 else None) if i % 4 else greedy
              for i in range(len(prompts))]
    params[4] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    model, outputs, logprobs = None, {}, {}
    for steps, queued in ((1, False), (None, False), (None, True)):
        core = _cuda_core(model, scheduler=SchedulerConfig(max_num_seqs=64, num_scheduler_steps=steps,
                                                           async_scheduling=queued))
        model = core.model
        launches = _record_queued_runs(core)
        outputs[steps, queued] = _tokens(core, prompts, params, logprobs.setdefault((steps, queued), {}))
        assert not queued or any(run is not None for run in launches)
        core.shutdown()
    assert outputs[None, False] == outputs[1, False] and outputs[None, True] == outputs[1, False]
    one = logprobs[1, False]
    assert set(one) == {f"r{i}" for i, request_params in enumerate(params) if request_params.logprobs is not None}
    for got in (logprobs[None, False], logprobs[None, True]):
        assert {rid: [(lp.token_id, list(lp.top)) for lp in lps] for rid, lps in got.items()} == \
            {rid: [(lp.token_id, list(lp.top)) for lp in lps] for rid, lps in one.items()}
        assert all(abs(a.logprob - b.logprob) < 1e-4 for rid in one for a, b in zip(got[rid], one[rid]))


def _record_queued_runs(core: EngineCore) -> list:
    """A list that gets what each of the core's attempts to queue a run returned (None: not queued)."""
    launches, launch_next_run = [], core.runner.launch_next_run

    def recording(*args):
        launches.append(launch_next_run(*args))
        return launches[-1]

    core.runner.launch_next_run = recording
    return launches
