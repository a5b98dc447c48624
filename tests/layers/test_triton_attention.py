"""The Triton paged attention kernel (layers/attention/triton_paged.py), run on the CPU by Triton's interpreter: it
matches the PyTorch reference's float64 softmax for decodes and prefill chunks (GQA, sliding window, soft-capping),
a query's output is bitwise the same alone, batched, padded or in a chunk, write_kv fills the right slots, the
selector picks it on CUDA only for a cache of the model's dtype, and a tiny Llama gives the reference's logits.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton (transformers does); on a
CUDA machine the kernel tests here are skipped, and test_triton_attention_gpu.py runs them on the compiled kernel."""

from __future__ import annotations

import pytest
import torch
from tiny_models import SeqStep, new_runner, run_step, tiny_llama

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.layers.attention import ScheduledSequence, select_backend, triton_paged
from serval.layers.attention.torch_reference import TorchReferenceBackend
from serval.layers.attention.triton_paged import TritonPagedBackend
from serval.model.loader import load_model

needs_interpreter = pytest.mark.skipif(not triton_paged.INTERPRETED,
                                       reason="no interpreter on a CUDA machine: see test_triton_attention_gpu.py")
BLOCK, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 16, 2, 4, 64, 24
# Bounds on |kernel - reference| (the reference computes in float64, then rounds to the cache's dtype): float32
# differs by summation order only; bfloat16 also rounds the softmax weights to bfloat16 for the second product, a
# relative error of at most 2^-8 a weight (measured max 0.016 on outputs of magnitude ~1).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1 / 32, rtol=1 / 64)}
# A step's mix: three decodes (one at 150, whose context spans three 64-key tiles), a prefill chunk with no earlier
# context, one after 60 cached tokens that crosses a tile boundary.
MIXED = [ScheduledSequence([3, 7, 1], 39, 1), ScheduledSequence([5], 4, 1),
         ScheduledSequence([0, 2, 4, 6, 8, 9, 10, 11, 12, 13], 150, 1), ScheduledSequence([14, 15], 0, 24),
         ScheduledSequence([16, 17, 18, 19, 20], 60, 20)]


def _setup(dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen).to(device, dtype)
    queries = torch.randn(200, HEADS, DIM, generator=gen).to(device, dtype)  # the query at each position
    return cache, queries


def _attend(backend, cache, queries, seqs, window=None, softcap=None, table_width=None):
    kwargs = {} if table_width is None else {"table_width": table_width}
    meta = backend.build_metadata(seqs, **kwargs)
    q = torch.cat([queries[s.num_computed_tokens: s.end] for s in seqs])
    k, v = (c.view(-1, KV_HEADS, DIM)[meta.slot_mapping] for c in cache)  # the new keys, as the cache holds them
    return backend.attend(q, k, v, cache[0], cache[1], meta, DIM**-0.5, window, softcap)


def check_matches_the_reference(device, dtype, window, softcap):
    cache, queries = _setup(dtype, device)
    got = _attend(TritonPagedBackend(device, dtype, BLOCK), cache, queries, MIXED, window, softcap)
    want = _attend(TorchReferenceBackend(device, dtype, BLOCK), cache, queries, MIXED, window, softcap)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def check_batch_invariance(device, window, softcap):
    """One decode at position 50: alone, third in a batch, with its table padded to 16 columns, as the last row of
    a chunk over cached context, and as row 50 of its whole prompt beside another sequence: the same bits."""
    cache, queries = _setup(torch.bfloat16, device)
    backend = TritonPagedBackend(device, torch.bfloat16, BLOCK)
    blocks = [3, 7, 1, 21]
    alone = _attend(backend, cache, queries, [ScheduledSequence(blocks, 50, 1)], window, softcap)[0]
    batched = _attend(backend, cache, queries, MIXED[1:3] + [ScheduledSequence(blocks, 50, 1)] + MIXED[3:],
                      window, softcap)[2]
    padded = _attend(backend, cache, queries, [ScheduledSequence(blocks, 50, 1)], window, softcap, table_width=16)[0]
    chunk = _attend(backend, cache, queries, [ScheduledSequence(blocks, 40, 11)], window, softcap)[-1]
    whole = _attend(backend, cache, queries, [ScheduledSequence(blocks, 0, 51)] + MIXED[:1], window, softcap)[50]
    for other in (batched, padded, chunk, whole):
        assert torch.equal(alone, other)


WINDOWS_AND_CAPS = [(None, None), (20, None), (None, 2.0), (70, 2.0)]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), WINDOWS_AND_CAPS)
@torch.inference_mode()
def test_the_kernel_matches_the_float64_reference(dtype, window, softcap):
    check_matches_the_reference("cpu", dtype, window, softcap)


@needs_interpreter
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 2.0)])
@torch.inference_mode()
def test_a_query_is_bitwise_the_same_alone_batched_padded_or_in_a_chunk(window, softcap):
    check_batch_invariance("cpu", window, softcap)


@needs_interpreter
@pytest.mark.parametrize(("block_size", "head_dim", "heads"), [(32, 80, 6), (8, 64, 2)])
@torch.inference_mode()
def test_other_block_sizes_head_dims_and_groups_match_the_reference(block_size, head_dim, heads):
    """Blocks of 32 and 8 tokens (each key's block looked up on its own), a head dim of 80 (padded to 128, masked),
    groups of 3 and 1 query heads per key/value head."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 16, block_size, 2, head_dim, generator=gen)
    seqs = [ScheduledSequence(torch.randperm(16, generator=gen)[: -(-100 // block_size)].tolist(), 99, 1)]
    q = torch.randn(1, heads, head_dim, generator=gen)
    results = []
    for backend in (TritonPagedBackend("cpu", torch.float32, block_size),
                    TorchReferenceBackend("cpu", torch.float32, block_size)):
        meta = backend.build_metadata(seqs)
        k, v = (c.view(-1, 2, head_dim)[meta.slot_mapping] for c in cache)
        results.append(backend.attend(q, k, v, cache[0], cache[1], meta, head_dim**-0.5, None))
    torch.testing.assert_close(results[0], results[1], **TOLERANCE[torch.float32])


def test_metadata_is_per_token_and_pads_tables_to_the_given_width():
    backend = TritonPagedBackend("cpu", torch.bfloat16, BLOCK)
    seqs = [ScheduledSequence([3, 0], 20, 1), ScheduledSequence([1, 2, 4], 30, 3)]
    meta = backend.build_metadata(seqs)
    assert meta.block_tables.dtype == meta.query_seq.dtype == meta.query_pos.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 0, 0], [1, 2, 4]]
    assert meta.query_seq.tolist() == [0, 1, 1, 1] and meta.query_pos.tolist() == [20, 30, 31, 32]
    assert meta.slot_mapping.tolist() == [0 * BLOCK + 4, 2 * BLOCK + 14, 2 * BLOCK + 15, 4 * BLOCK + 0]
    assert backend.build_metadata(seqs, table_width=5).block_tables.tolist() == [[3, 0, 0, 0, 0], [1, 2, 4, 0, 0]]
    with pytest.raises(ValueError, match="narrower"):
        backend.build_metadata(seqs, table_width=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_write_kv_puts_each_row_in_its_slot(dtype):
    backend = TritonPagedBackend("cpu", dtype, BLOCK)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=dtype)
    seqs = [ScheduledSequence([3, 0], 20, 1), ScheduledSequence([1, 2, 4], 30, 3)]
    meta = backend.build_metadata(seqs)
    k, v = torch.randn(2, 4, KV_HEADS, DIM).to(dtype).unbind(0)
    backend.write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
    where = [(0, 4), (2, 14), (2, 15), (4, 0)]  # (block, slot) of positions 20 of [3, 0] and 30..32 of [1, 2, 4]
    for row, (block, slot) in enumerate(where):
        assert torch.equal(cache[0, block, slot], k[row]) and torch.equal(cache[1, block, slot], v[row])
    assert torch.count_nonzero(cache) == 2 * 4 * KV_HEADS * DIM  # and nothing else was written


def test_the_selector_takes_triton_on_cuda_for_a_model_dtype_cache_only(monkeypatch):
    monkeypatch.delenv("SERVAL_ATTENTION_BACKEND", raising=False)
    cuda = torch.device("cuda", 0)
    assert isinstance(select_backend(cuda, torch.bfloat16, BLOCK), TritonPagedBackend)
    assert type(select_backend(cuda, torch.int8, BLOCK)) is TorchReferenceBackend  # 8-bit rows: the reference
    assert type(select_backend(cuda, torch.float8_e4m3fn, BLOCK)) is TorchReferenceBackend
    assert not isinstance(select_backend("cpu", torch.bfloat16, BLOCK), TritonPagedBackend)
    monkeypatch.setenv("SERVAL_ATTENTION_BACKEND", "torch")
    assert type(select_backend(cuda, torch.bfloat16, BLOCK)) is TorchReferenceBackend


@needs_interpreter
@torch.inference_mode()
def test_a_tiny_llama_gives_the_reference_logits_with_the_triton_backend(tmp_path):
    """Through the engine's runner: a chunked prefill of one sequence beside another's decodes, then decodes of
    both, with each backend; the logits agree within the model tests' fp32 tolerance (1e-5 of the logits' scale,
    tests/model/test_llama.py), and so do the greedy tokens. (The tiny Llama's heads are 16 wide.)"""
    tiny_llama().save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32)
    gen = torch.Generator().manual_seed(2)
    tokens = {"a": torch.randint(0, 256, (30,), generator=gen).tolist(),
              "b": torch.randint(0, 256, (20,), generator=gen).tolist()}
    blocks = {"a": [4, 9, 1], "b": [0, 7]}
    schedule = {"a": [20, 1, 1, 1], "b": [12, 5, 1, 1]}

    def logits(backend) -> dict[str, torch.Tensor]:
        runner = new_runner(model, 12, BLOCK, torch.float32)
        runner.attention_backend = backend
        done, got = dict.fromkeys(tokens, 0), {n: [] for n in tokens}
        for step in range(4):
            seqs = [SeqStep(tokens[n][done[n]: done[n] + schedule[n][step]], done[n], blocks[n]) for n in tokens]
            order = sorted(tokens, key=lambda n: schedule[n][step] > 1)  # decodes first, as the scheduler hands them
            for n, out in zip(order, run_step(runner, [seqs[list(tokens).index(n)] for n in order])):
                got[n].append(out)
                done[n] += schedule[n][step]
        return {n: torch.cat(parts) for n, parts in got.items()}

    by_triton = logits(TritonPagedBackend("cpu", torch.float32, BLOCK))
    by_reference = logits(TorchReferenceBackend("cpu", torch.float32, BLOCK))
    for name in tokens:
        scale = by_reference[name].abs().max()
        assert (by_triton[name] - by_reference[name]).abs().max() <= 1e-5 * scale
        assert torch.equal(by_triton[name].argmax(-1), by_reference[name].argmax(-1))


@needs_interpreter
@torch.inference_mode()
def test_the_engine_gives_the_reference_greedy_tokens_with_the_triton_backend(tmp_path):
    """A tiny Llama through the engine core in float32: two prompts, chunked by a 16-token budget beside each
    other's decodes, 10 greedy tokens each: the same tokens with either backend."""
    tiny_llama(seed=5).save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32)
    prompts = {"a": list(range(3, 40)), "b": [9, 8, 7, 6, 5]}

    def greedy(backend) -> dict[str, list[int]]:
        config = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=32, block_size=BLOCK),
                              scheduler=SchedulerConfig(max_num_batched_tokens=16),
                              speculative=SpeculativeConfig(method=None))
        core = EngineCore(config, tmp_path, model)
        core.runner.attention_backend = backend
        for name, prompt in prompts.items():
            core.add_request(EngineCoreRequest(name, prompt, SamplingParams(
                temperature=0, max_tokens=10, ignore_eos=True), [], 10))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    by_triton = greedy(TritonPagedBackend("cpu", torch.float32, BLOCK))
    assert {n: len(t) for n, t in by_triton.items()} == {"a": 10, "b": 10}
    assert by_triton == greedy(TorchReferenceBackend("cpu", torch.float32, BLOCK))


@torch.inference_mode()
def test_write_kv_takes_keys_and_values_as_views_of_the_qkv_rows():
    """As the model passes them (strided views of one qkv output), with 3 heads of 24 (both padded in the kernel)."""
    heads, kv_heads, dim = 6, 3, 24
    backend = TritonPagedBackend("cpu", torch.bfloat16, BLOCK)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, kv_heads, dim, dtype=torch.bfloat16)
    seqs = [ScheduledSequence([3, 0], 20, 1), ScheduledSequence([1, 2, 4], 30, 3)]
    meta = backend.build_metadata(seqs)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    _, k, v = qkv.view(4, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    backend.write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
    want = torch.zeros_like(cache)
    for c, x in ((want[0], k), (want[1], v)):
        c.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, x)
    assert torch.equal(cache, want)
