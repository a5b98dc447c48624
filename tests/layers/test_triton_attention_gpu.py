"""The Triton paged attention kernel compiled on CUDA: the same checks as test_triton_attention.py (which runs it in
Triton's CPU interpreter), a CUDA-graph replay of write_kv + attend equal to eager steps, and its time for a decode
batch beside the PyTorch reference's (printed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_triton_attention import (
    BLOCK,
    DIM,
    KV_HEADS,
    TOLERANCE,
    WINDOWS_AND_CAPS,
    _setup,
    check_batch_invariance,
    check_matches_the_reference,
)

from serval.layers.attention import ScheduledSequence, paged_attention
from serval.layers.attention.torch_reference import TorchReferenceBackend
from serval.layers.attention.triton_paged import TritonPagedBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), WINDOWS_AND_CAPS)
@torch.inference_mode()
def test_on_cuda_the_kernel_matches_the_float64_reference(dtype, window, softcap):
    check_matches_the_reference("cuda", dtype, window, softcap)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 2.0)])
@torch.inference_mode()
def test_on_cuda_a_query_is_bitwise_the_same_alone_batched_padded_or_in_a_chunk(window, softcap):
    check_batch_invariance("cuda", window, softcap)


@torch.inference_mode()
def test_a_decode_step_captured_in_a_cuda_graph_replays_as_eager():
    """write_kv and attend of a 4-sequence decode batch (tables padded to 8 columns), captured once; two later steps
    written into its buffers in place and replayed give the eager steps' outputs and cache, bit for bit."""
    dtype, dim, kv_heads = torch.bfloat16, DIM, KV_HEADS
    cache, queries = _setup(dtype, "cuda")
    backend = TritonPagedBackend("cuda", dtype, BLOCK)
    tables = [[3, 7, 1, 21], [5, 6], [0, 2, 4, 8, 9], [10]]  # disjoint: no two sequences write one slot
    gen = torch.Generator(device="cuda").manual_seed(1)

    def step(lengths):
        meta = backend.build_metadata([ScheduledSequence(t, n, 1) for t, n in zip(tables, lengths)], table_width=8)
        k, v = torch.randn(2, len(lengths), kv_heads, dim, generator=gen, device="cuda").to(dtype)
        return meta, queries[lengths].clone(), k, v

    def run(meta, q, k, v, kv):
        return paged_attention(q, k, v, kv[0], kv[1], meta, dim**-0.5, 40, None)

    static = step([50, 20, 70, 3])
    run(*static, cache.clone())  # compiles the kernel outside the capture
    graph_cache, eager_cache = cache.clone(), cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(*static, graph_cache)
    for lengths in ([50, 20, 70, 3], [51, 21, 71, 4]):
        meta, q, k, v = step(lengths)
        for f in dataclasses.fields(meta):
            if isinstance(getattr(meta, f.name), torch.Tensor):
                getattr(static[0], f.name).copy_(getattr(meta, f.name))
        for buffer, value in zip(static[1:], (q, k, v)):
            buffer.copy_(value)
        graph.replay()
        want = run(meta, q, k, v, eager_cache)
        assert torch.equal(static_out, want) and torch.equal(graph_cache, eager_cache)


@torch.inference_mode()
def test_decode_time_at_64_sequences_of_512_tokens():
    """The embedded model's attention shape (9 query heads over 3 key/value heads of 64), bf16: prints each backend's
    time for one layer's decode attention of 64 sequences at context 512, and checks they agree."""
    dtype, heads, kv_heads, dim, seqs, context = torch.bfloat16, 9, 3, 64, 64, 512
    blocks_per_seq = context // BLOCK
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, seqs * blocks_per_seq, BLOCK, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    q = torch.randn(seqs, heads, dim, generator=gen, device="cuda").to(dtype)
    batch = [ScheduledSequence(list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), context - 1, 1)
             for i in range(seqs)]
    outputs, times = {}, {}
    for name, backend in [("triton", TritonPagedBackend("cuda", dtype, BLOCK)),
                          ("torch reference", TorchReferenceBackend("cuda", dtype, BLOCK))]:
        meta = backend.build_metadata(batch)
        k, v = (c.view(-1, kv_heads, dim)[meta.slot_mapping] for c in cache)

        def attend(backend=backend, meta=meta, k=k, v=v):
            return backend.attend(q, k, v, cache[0], cache[1], meta, dim**-0.5, None)

        for _ in range(3):  # compile and warm up
            outputs[name] = attend()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            attend()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 20 * 1000
    print(f"\ndecode attention, {seqs} sequences x {context} tokens, {heads}/{kv_heads} heads of {dim}, bf16, "
          f"{torch.cuda.get_device_name()}: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items()))
    torch.testing.assert_close(outputs["triton"], outputs["torch reference"], **TOLERANCE[dtype])
