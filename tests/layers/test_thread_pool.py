"""The CPU kernels' own worker threads (csrc/thread_pool.h), through the kernels that run on them: the block linears
(bfloat16 dot products, float32 FMAs and int8 activations), paged attention and the row ops between them (norms,
RoPE, activations, argmax). Whichever thread takes a chunk, and
however many threads there are, each output has the same bits; two callers at once (one runs inline while the other
holds the pool) both get their own right answer; and a forked child, which has none of its parent's threads, gets
its answer."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from test_block_quant_linear import activations, random_blocks

from serval.layers import cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs the C++ kernels")
FORMATS = ["Q4_K", "Q6_K", "q8"]
WAYS = ["float", "int8"]


def linear(fmt: str, rows: int, way: str, out_features: int = 1000, in_features: int = 512):
    """A call of a kernel for bfloat16 rows: "float" the float kernel users get (the dot products where compiled,
    else the FMAs), "int8" int8 activations (the vector kernel)."""
    weight = random_blocks(fmt, out_features, in_features)
    panels = weight.panels()
    x = activations(rows, weight.in_features, torch.bfloat16)
    if way == "int8":
        if not kernels.block_int8_kernel_available():
            pytest.skip("no int8 kernel in this build")
        return lambda: kernels.block_panel_linear_int8(x, *panels, weight.format, out_features, True, "vector")
    dot = kernels.block_bf16_dot_kernel_available()
    kernel = kernels.block_panel_linear_bf16_dot if dot else kernels.block_panel_linear
    return lambda: kernel(x, *panels, weight.format, out_features, True)


def with_threads(threads: int, call):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 40])  # decoded in registers; decoded once per tile
@pytest.mark.parametrize("way", WAYS)
def test_linear_bits_do_not_depend_on_the_threads(fmt, rows, way):
    call = linear(fmt, rows, way)
    alone = with_threads(1, call)
    for threads in (2, 3, 4):
        for _ in range(3):  # chunks land on other threads each time
            assert torch.equal(with_threads(threads, call), alone)


def attention_inputs(tokens_per_sequence=(1, 1, 1, 7), context=(33, 70, 5, 20), heads=8, kv_heads=2, head_dim=64):
    """A paged cache of random rows and one step's queries: three decode tokens and a prefill chunk of 7."""
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 32
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    tables = torch.randperm(num_blocks, generator=generator)[:4 * 5].view(4, 5).long()
    token_table, lens = [], []
    for sequence, (count, ctx) in enumerate(zip(tokens_per_sequence, context, strict=True)):
        token_table += [sequence] * count
        lens += list(range(ctx - count + 1, ctx + 1))
    q = torch.randn(len(lens), heads, head_dim, generator=generator).bfloat16()
    return q, k_cache, v_cache, tables, torch.tensor(token_table), torch.tensor(lens)


def test_attention_bits_do_not_depend_on_the_threads():
    inputs = attention_inputs()

    def call():
        return kernels.paged_attention(*inputs, 0.125)

    alone = with_threads(1, call)
    for threads in (2, 4):
        for _ in range(3):
            assert torch.equal(with_threads(threads, call), alone)


def _rotated(x: torch.Tensor) -> torch.Tensor:
    """x [64, 2048] as 64 tokens of 32 heads of 64, each rotated in place by its position."""
    out = x.clone().view(64, 32, 64)
    angles = torch.arange(64 * 64, dtype=torch.float32).view(64, 64) / 1000
    kernels.rotary_embedding_(out, torch.arange(64), angles.cos(), angles.sin())
    return out


ROW_OPS = {
    "rotary_embedding_": lambda x, w: _rotated(x),
    "add_rms_norm": lambda x, w: kernels.add_rms_norm(x, x.flip(0).contiguous(), w, 1e-6),
    "gemma_rms_norm": lambda x, w: kernels.gemma_rms_norm(x, w, 1e-6, 8, x.flip(0).contiguous(), w.flip(0)),
    "silu_and_mul": lambda x, w: kernels.silu_and_mul(x),
    "gelu_tanh_and_mul": lambda x, w: kernels.gelu_tanh_and_mul(x, 8),
    "argmax_rows": lambda x, w: kernels.argmax_rows(x.float()),
}


@pytest.mark.parametrize("op", list(ROW_OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_op_bits_do_not_depend_on_the_threads(op, dtype):
    """64 rows of 2048: more than one piece, so that the workers take some (a decode step's batch of 8 rows of a
    1B model's 2048 or 8192 already splits)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 2048, generator=generator).to(dtype)
    weight = torch.randn(2048, generator=generator).to(dtype)

    def call():
        return ROW_OPS[op](x, weight)

    alone = with_threads(1, call)
    for threads in (2, 3, 4):
        for _ in range(3):
            got = with_threads(threads, call)
            for a, b in zip(got if isinstance(got, tuple) else (got,), alone if isinstance(alone, tuple) else (alone,),
                            strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("way", WAYS)
def test_two_callers_at_once_each_get_their_answer(way):
    calls = [linear(fmt, rows, way) for fmt in FORMATS for rows in (1, 9)]
    want = [call() for call in calls]
    failures: list[str] = []

    def caller(index: int) -> None:
        for round_ in range(30):
            i = (index + round_) % len(calls)
            if not torch.equal(calls[i](), want[i]):
                failures.append(f"caller {index}, call {i}")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a caller never returned"
    assert failures == []


def _in_child(call, want, queue) -> None:
    queue.put(torch.equal(call(), want))  # nothing else here: libgomp's own regions hang in a child forked after them


@pytest.mark.parametrize("way", WAYS)
def test_a_forked_child_gets_its_answer(way):
    """The parent's pool has its workers; the child's copy of it has none, and a call that waited for them would
    never return (the child makes a pool of its own)."""
    call = linear("Q4_K", 1, way)
    want = with_threads(1, call)
    assert torch.equal(call(), want)  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(call, want, queue))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's kernel call never returned")
    assert child.exitcode == 0 and queue.get(timeout=5) is True
