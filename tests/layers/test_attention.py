"""Paged attention, on both paths (the C++ CPU kernel and the PyTorch float64 routine): a query's output is bitwise
the same alone, in a padded batch of decodes, or as a row of a prefill chunk — the property that keeps greedy output
independent of batching, chunking and preemption — and matches a float64 softmax."""

from __future__ import annotations

import pytest
import torch

from serval.layers import cpu_kernels
from serval.layers.attention import AttentionBackend, ScheduledSequence, paged_attention, select_backend
from serval.layers.attention.cpu_kernel import CpuKernelBackend
from serval.layers.attention.torch_reference import TorchReferenceBackend

BLOCK, KV_HEADS, HEADS, DIM = 16, 3, 9, 64
PATHS = ["cpu_kernel", "float64"]  # the C++ kernel backend (per-token metadata), and the PyTorch float64 reference


def _backend(path: str, dtype: torch.dtype) -> AttentionBackend:
    """The backend of ``path``: "cpu_kernel" as the runner selects it on this CPU, "float64" the PyTorch one."""
    if path == "float64":
        return TorchReferenceBackend("cpu", dtype, BLOCK)
    backend = select_backend("cpu", dtype, BLOCK)
    if not isinstance(backend, CpuKernelBackend):
        pytest.skip("the C++ kernels could not be built here")
    return backend


def _setup(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 32, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)  # 32 blocks of keys and values
    queries = torch.randn(300, HEADS, DIM, generator=gen).to(dtype)  # the query at each position
    return cache, queries


def _decode(cache, queries, seqs: list[tuple[list[int], int]], path: str) -> torch.Tensor:
    """Decodes of several sequences in one batch; each is (block ids, its length including the new token)."""
    slots = torch.tensor([blocks[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for blocks, n in seqs])
    flat_k, flat_v = cache[0].view(-1, KV_HEADS, DIM), cache[1].view(-1, KV_HEADS, DIM)
    meta = _backend(path, queries.dtype).build_metadata([ScheduledSequence(blocks, n - 1, 1) for blocks, n in seqs])
    assert torch.equal(meta.slot_mapping, slots)
    q = torch.stack([queries[n - 1] for _, n in seqs])
    return paged_attention(q, flat_k[slots], flat_v[slots], cache[0], cache[1], meta, DIM**-0.5)


def _prefill_chunk(cache, queries, blocks: list[int], start: int, end: int, path: str) -> torch.Tensor:
    """Positions start..end-1 of one sequence as a prefill chunk over the cached context before them."""
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)])
    flat_k, flat_v = cache[0].view(-1, KV_HEADS, DIM), cache[1].view(-1, KV_HEADS, DIM)
    meta = _backend(path, queries.dtype).build_metadata([ScheduledSequence(blocks, start, end - start)])
    assert torch.equal(meta.slot_mapping, slots)
    return paged_attention(queries[start:end], flat_k[slots], flat_v[slots], cache[0], cache[1], meta, DIM**-0.5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@torch.inference_mode()
def test_a_query_is_the_same_alone_batched_padded_or_in_a_chunk(dtype, path):
    cache, queries = _setup(dtype)
    a_blocks, b_blocks, c_blocks = [3, 7, 1], [0, 2, 4, 5, 6, 8, 9, 10, 11, 12], [13, 14]
    alone = _decode(cache, queries, [(a_blocks, 40)], path)[0]
    # Beside longer and shorter neighbours: A's keys are padded to 10 blocks, and the batch has 3 rows.
    batched = _decode(cache, queries, [(b_blocks, 150), (a_blocks, 40), (c_blocks, 20)], path)[1]
    assert torch.equal(alone, batched)
    # Position 39 as the last row of a prefill chunk, and of the whole prompt at once.
    assert torch.equal(alone, _prefill_chunk(cache, queries, a_blocks, 30, 40, path)[-1])
    assert torch.equal(alone, _prefill_chunk(cache, queries, a_blocks, 0, 40, path)[-1])


@pytest.mark.parametrize("path", PATHS)
@torch.inference_mode()
def test_attention_matches_a_float64_softmax(path):
    cache, queries = _setup(torch.float32)
    blocks = [3, 7, 1]
    got = _prefill_chunk(cache, queries, blocks, 0, 40, path).double()
    keys = cache[0, blocks].flatten(0, 1)[:40].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = cache[1, blocks].flatten(0, 1)[:40].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries[:40].double(), keys) * DIM**-0.5
    scores.masked_fill_(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("path", PATHS)
@torch.inference_mode()
def test_soft_capped_scores_match_a_float64_softmax_and_stay_batch_invariant(path, monkeypatch):
    """Gemma 2's attention logit soft-capping (scores capped by softcap * tanh(s / softcap)), with a sliding window:
    rows of a chunk are within float32 error of a float64 softmax of the capped scores, and a query's result is
    bitwise the same as a decode alone, beside other decodes, or in a chunk. The kernel's backend caps the scores in
    the kernel (the PyTorch reference is never called) and agrees with the reference within float32 error."""
    reference_calls = []
    reference_attend = TorchReferenceBackend.attend
    monkeypatch.setattr(TorchReferenceBackend, "attend",
                        lambda *args, **kw: reference_calls.append(1) or reference_attend(*args, **kw))
    cache, queries = _setup(torch.float32)
    queries = queries * 4  # scores of several units, so that a cap of 2 changes them a lot
    blocks, softcap, window, scale = [3, 7, 1], 2.0, 24, DIM**-0.5
    flat_k, flat_v = cache[0].view(-1, KV_HEADS, DIM), cache[1].view(-1, KV_HEADS, DIM)

    def attend(seqs: list[ScheduledSequence], q: torch.Tensor, backend: str = path) -> torch.Tensor:
        meta = _backend(backend, q.dtype).build_metadata(seqs)
        return paged_attention(q, flat_k[meta.slot_mapping], flat_v[meta.slot_mapping], cache[0], cache[1], meta,
                               scale, window=window, softcap=softcap)

    chunk = attend([ScheduledSequence(blocks, 30, 10)], queries[30:40])
    keys = cache[0, blocks].flatten(0, 1)[:40].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = cache[1, blocks].flatten(0, 1)[:40].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries[30:40].double(), keys) * scale
    capped = torch.tanh(scores / softcap) * softcap
    q_pos, key_pos = torch.arange(30, 40)[:, None], torch.arange(40)[None, :]
    outside = (key_pos > q_pos) | (key_pos <= q_pos - window)
    want = torch.einsum("hqk,khd->qhd", capped.masked_fill(outside, float("-inf")).softmax(-1), values)
    uncapped = torch.einsum("hqk,khd->qhd", scores.masked_fill(outside, float("-inf")).softmax(-1), values)
    assert (chunk.double() - want).abs().max() < 1e-5 < (uncapped - want).abs().max() / 100
    alone = attend([ScheduledSequence(blocks, 39, 1)], queries[39:40])
    beside = attend([ScheduledSequence([0, 2, 4, 5], 60, 1), ScheduledSequence(blocks, 39, 1)],
                    torch.stack([queries[60], queries[39]]))
    assert torch.equal(alone[0], chunk[-1]) and torch.equal(beside[1], chunk[-1])
    assert len(reference_calls) == (3 if path == "float64" else 0)
    reference = attend([ScheduledSequence(blocks, 30, 10)], queries[30:40], "float64")
    assert (chunk.double() - reference.double()).abs().max() < 1e-5


@pytest.mark.parametrize(("head_dim", "window"), [(64, None), (256, 100), (128, 37), (80, 37)])  # 80: per query
@torch.inference_mode()
def test_every_soft_capped_row_of_a_long_chunk_equals_its_decode_and_a_float64_softmax(head_dim, window):
    """The kernel's soft-capping (Gemma 2): each of 70 rows of a chunk (contexts 531-600, tiles cut at 64 queries and
    256 keys, with and without a sliding window whose first keys fall mid-tile) is bitwise its own decode, and all
    are within float32 error of a float64 softmax of the capped scores (scores of several units against a cap of 2:
    the tanh's small and large arguments both), which the uncapped softmax is far from."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    gen = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache = (torch.randn(48, BLOCK, KV_HEADS, head_dim, generator=gen) for _ in range(2))
    queries = torch.randn(70, HEADS, head_dim, generator=gen) * 3
    table = torch.randperm(48, generator=gen)[:38][None]
    lens, rows, scale, softcap = torch.arange(531, 601), torch.zeros(70, dtype=torch.long), head_dim**-0.5, 2.0
    chunk = kernels.paged_attention(queries, k_cache, v_cache, table, rows, lens, scale, window or 0, softcap)
    for i in range(70):
        alone = kernels.paged_attention(queries[i: i + 1].contiguous(), k_cache, v_cache, table, rows[:1],
                                        lens[i: i + 1], scale, window or 0, softcap)
        assert torch.equal(chunk[i], alone[0]), i
    keys = k_cache[table[0]].flatten(0, 1)[:600].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = v_cache[table[0]].flatten(0, 1)[:600].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries.double(), keys) * scale
    key_pos, ctx = torch.arange(600)[None, None], lens[None, :, None]
    outside = (key_pos >= ctx) | (key_pos < ctx - (window or 600))
    want = torch.einsum("hqk,khd->qhd", (torch.tanh(scores / softcap) * softcap).masked_fill(outside, -torch.inf)
                        .softmax(-1), values)
    uncapped = torch.einsum("hqk,khd->qhd", scores.masked_fill(outside, -torch.inf).softmax(-1), values)
    assert (chunk.double() - want).abs().max() < 1e-5 < (uncapped - want).abs().max() / 100


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [None, 24])
@torch.inference_mode()
def test_a_padded_table_width_gives_bitwise_the_same_output(path, window):
    """build_metadata(seqs, table_width): every block table padded to a fixed width (what a CUDA graph's fixed shapes
    need) changes no result, for decodes (with and without a sliding window) and a prefill chunk after them; the
    decode tables are exactly that wide. A table wider than the width is refused."""
    cache, queries = _setup(torch.bfloat16)
    flat_k, flat_v = cache[0].view(-1, KV_HEADS, DIM), cache[1].view(-1, KV_HEADS, DIM)
    seqs = [ScheduledSequence([3, 7, 1], 39, 1), ScheduledSequence([0, 2, 4, 5, 6], 70, 1),
            ScheduledSequence([13, 14], 20, 6)]
    q = torch.cat([queries[39:40], queries[70:71], queries[20:26]])
    backend = _backend(path, q.dtype)

    def attend(meta):
        return paged_attention(q, flat_k[meta.slot_mapping], flat_v[meta.slot_mapping], cache[0], cache[1], meta,
                               DIM**-0.5, window=window)

    padded = backend.build_metadata(seqs, table_width=12)
    tables = padded.block_tables if path == "cpu_kernel" else padded.decode_block_tables
    assert tables.shape[1] == 12
    assert torch.equal(attend(backend.build_metadata(seqs)), attend(padded))
    with pytest.raises(ValueError, match="table_width"):
        backend.build_metadata(seqs, table_width=4)


@torch.inference_mode()
def test_without_the_kernel_the_runner_selects_the_float64_path(monkeypatch):
    """SERVAL_CPU_KERNELS=0 (or a machine that cannot build it): the backend the runner selects gives the float64
    result."""
    cache, queries = _setup(torch.bfloat16)
    with_kernel = _prefill_chunk(cache, queries, [3, 7, 1], 0, 40, "cpu_kernel")
    monkeypatch.setenv("SERVAL_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.load() is None
    backend = select_backend("cpu", torch.bfloat16, BLOCK)
    assert isinstance(backend, TorchReferenceBackend)
    slots = torch.tensor([[3, 7, 1][p // BLOCK] * BLOCK + p % BLOCK for p in range(40)])
    meta = backend.build_metadata([ScheduledSequence([3, 7, 1], 0, 40)])
    fallback = paged_attention(queries[:40], cache[0].view(-1, KV_HEADS, DIM)[slots],
                               cache[1].view(-1, KV_HEADS, DIM)[slots], cache[0], cache[1], meta, DIM**-0.5)
    assert torch.equal(fallback, _prefill_chunk(cache, queries, [3, 7, 1], 0, 40, "float64"))
    assert (fallback.float() - with_kernel.float()).abs().max() < 0.02  # two float32-accurate results in bf16


# (query heads, key/value heads): the kernel scores up to 4 of a token's heads side by side and sums the values of
# up to 6 heads of whole tokens at once: 3 a token (2 tokens together), 1 (6 tokens), 8 (split) and 5 (one token).
HEAD_GROUPS = [(HEADS, KV_HEADS), (6, 6), (8, 1), (10, 2)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_GROUPS)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])  # 80: no tiled kernel for it, the per-query loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_every_row_of_a_long_chunk_equals_its_decode_and_a_float64_softmax(dtype, head_dim, num_heads, num_kv_heads):
    """The C++ kernel takes a sequence's queries in tiles of 64 that share keys and values, and goes over the keys
    64 at a time for all of a tile's heads, scoring several heads of a token at once and summing the values of
    several tokens at once: each of 70 rows of a chunk (tiles cut at 64; contexts 531-600, not multiples of 16, so
    that tokens taken together part within a key block) is bitwise its own decode, and all are within float32 error
    (and, in bfloat16, the output's rounding) of a float64 softmax, for every head size a tiled kernel is built for
    and every grouping of query heads. A decode reads a bfloat16 cache's keys by its own transpose
    (paged_attention.cpp, bf16_key_pairs) and a float32 cache's by transpose16: both give the chunk's bits."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(48, BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    queries = torch.randn(70, num_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(48, generator=gen)[:38][None]  # 38 blocks: 608 slots, the last ones past every context
    k_cache[table[0, -1], 8:] = v_cache[table[0, -1], 8:] = float("nan")  # what a slot past the context may hold
    lens = torch.arange(531, 601)
    scale = head_dim**-0.5
    chunk = kernels.paged_attention(queries, k_cache, v_cache, table, torch.zeros(70, dtype=torch.long), lens, scale)
    for i in range(70):
        alone = kernels.paged_attention(queries[i: i + 1].contiguous(), k_cache, v_cache, table,
                                        torch.zeros(1, dtype=torch.long), lens[i: i + 1], scale)
        assert torch.equal(chunk[i], alone[0]), i
    keys = k_cache[table[0]].flatten(0, 1)[:600].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    values = v_cache[table[0]].flatten(0, 1)[:600].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries.double(), keys) * scale
    scores.masked_fill_(torch.arange(keys.shape[0])[None, None] >= lens[None, :, None], float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    rounding = 0.0 if dtype == torch.float32 else 2.0**-8  # bfloat16 keeps 8 significant bits
    assert ((chunk.double() - want).abs() <= want.abs() * rounding + 1e-5).all()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(HEADS, KV_HEADS), (6, 6)])
@pytest.mark.parametrize("window", [100, 512, 37])
@pytest.mark.parametrize("head_dim", [64, 256, 80])
@torch.inference_mode()
def test_a_sliding_window_row_equals_its_decode_and_a_float64_softmax_over_its_window(head_dim, window, num_heads,
                                                                                      num_kv_heads):
    """Gemma's local layers: each query sees its last ``window`` keys. Every row of a 70-query chunk (contexts
    531-600, so the rows' first keys differ and fall mid-tile, and tokens whose values are summed together start at
    different keys) is bitwise its own decode, and within float32 error of a float64 softmax over exactly its window;
    the float64 path (no kernel) agrees."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    gen = torch.Generator().manual_seed(window)
    k_cache, v_cache = (torch.randn(48, BLOCK, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    queries = torch.randn(70, num_heads, head_dim, generator=gen)
    table = torch.randperm(48, generator=gen)[:38][None]
    lens = torch.arange(531, 601)
    scale = head_dim**-0.5
    rows = torch.zeros(70, dtype=torch.long)
    chunk = kernels.paged_attention(queries, k_cache, v_cache, table, rows, lens, scale, window)
    for i in range(70):
        alone = kernels.paged_attention(queries[i: i + 1].contiguous(), k_cache, v_cache, table, rows[:1],
                                        lens[i: i + 1], scale, window)
        assert torch.equal(chunk[i], alone[0]), i
    keys = k_cache[table[0]].flatten(0, 1)[:600].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    values = v_cache[table[0]].flatten(0, 1)[:600].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries.double(), keys) * scale
    key_pos, ctx = torch.arange(600)[None, None], lens[None, :, None]
    scores.masked_fill_((key_pos >= ctx) | (key_pos < ctx - window), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    assert (chunk.double() - want).abs().max() < 1e-5
    # The PyTorch path: the same rows as a prefill chunk of positions 530..599 over the cached context.
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    blocks = table[0].tolist()
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(530, 600)])
    meta = TorchReferenceBackend("cpu", torch.float32, BLOCK).build_metadata([ScheduledSequence(blocks, 530, 70)])
    assert meta.prefills[0].mask.tolist() == (torch.arange(600)[None, :] <= torch.arange(530, 600)[:, None]).tolist()
    assert torch.equal(meta.slot_mapping, slots)
    fallback = paged_attention(queries, flat_k[slots], flat_v[slots], k_cache, v_cache, meta, scale, window)
    assert (fallback.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_from_the_fused_projection_land_in_their_slots(dtype):
    """The kernel that writes a step's keys and values in one call stores what index_copy_ stores, from the views of
    the fused q/k/v output the model passes it, and refuses a slot outside the cache."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("CPU kernels not built")
    tokens, heads, kv_heads, head_dim, blocks, block_size = 5, 6, 2, 64, 4, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 17, 0, 63, 40])
    k_cache, v_cache = (torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    kernels.write_kv_(k_cache, v_cache, k, v, slots)
    for cache, x in ((k_cache, k), (v_cache, v)):
        expected = torch.zeros_like(cache)
        expected.view(-1, kv_heads, head_dim).index_copy_(0, slots, x)
        assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv_(k_cache, v_cache, k, v, torch.tensor([0, 1, 2, 3, 64]))
