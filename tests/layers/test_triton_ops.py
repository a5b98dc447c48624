"""The fused Triton kernels of a decoder layer's CUDA path (serval/layers/triton_kernels.py): residual add + RMSNorm,
SiLU-and-mul and RoPE in place, each against the PyTorch lines it replaces, and each row the same alone or in a
batch. The CPU part calls the kernels on CPU tensors under Triton's interpreter (tests/conftest.py); the GPU part
(skipped without CUDA) runs the same checks compiled and prints a SmolLM2-shaped layer stack's kernels per decode
step and step time, PyTorch path against the kernels.

Tolerances against the PyTorch path: the residual stream, SiLU-and-mul's rounding points and RoPE are the same
arithmetic, so r and RoPE are bitwise equal; the norm's sum (another order) and silu's exp (another formula) may
move a result by one rounding step of the dtype (2 * eps relative, as tests/layers/test_fused_ops.py allows the C++
kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serval.layers import triton_kernels, triton_ops
from serval.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference_norm(x, residual, weight, eps):
    r = x if residual is None else x + residual
    return weight * F.rms_norm(r.float(), weight.shape, eps=eps).to(r.dtype), r


def reference_silu_and_mul(gate_up):
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def reference_rotary(x, positions, rope):
    cos = rope.cos[positions].unsqueeze(1).to(x.dtype)
    sin = rope.sin[positions].unsqueeze(1).to(x.dtype)
    return RotaryEmbedding.apply(x, cos, sin)


def within_one_rounding(got, want):
    eps = torch.finfo(want.dtype).eps
    return bool(torch.all((got.float() - want.float()).abs() <= 2 * eps * want.float().abs() + 1e-6))


def norm_inputs(dtype, device="cpu", rows=7, hidden=96):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
    residual = (torch.randn(rows, hidden, generator=g) * 10).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device)
    return x, residual, weight


def rotary_inputs(dtype, device="cpu", tokens=5, heads=(3, 1), head_dim=16):
    """Queries and keys as the model passes them: a [T, heads, D] view into the wider qkv output."""
    rope = RotaryEmbedding(head_dim, 64, 10000.0).to(device)
    g = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads = heads
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(tokens, -1, head_dim)
    positions = torch.tensor([0, 3, 17, 63, 40][:tokens], device=device)
    return rope, qkv, qk, positions


# ---- the kernels against the PyTorch path, under the interpreter (CPU) or compiled (CUDA) ----

def check_add_rms_norm(dtype, with_residual, device):
    x, residual, weight = norm_inputs(dtype, device)
    residual = residual if with_residual else None
    out, r = triton_kernels.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_r = reference_norm(x, residual, weight, 1e-5)
    assert out.dtype == want_out.dtype and r.dtype == want_r.dtype
    assert torch.equal(r, want_r)  # the residual stream: the same rounded add
    assert within_one_rounding(out, want_out)


def check_silu_and_mul(dtype, device):
    g = torch.Generator().manual_seed(2)
    # wider than SILU_BLOCK, so a row spans two programs; large |gate| at both ends (exp's overflow side)
    gate_up = (torch.randn(3, 2 * (triton_kernels.SILU_BLOCK + 40), generator=g) * 6).to(dtype).to(device)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    got = triton_kernels.silu_and_mul(gate_up)
    want = reference_silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert within_one_rounding(got, want)


def check_rotary(dtype, device):
    rope, qkv, qk, positions = rotary_inputs(dtype, device)
    want = reference_rotary(qk.clone(), positions, rope)
    v_before = qkv[:, qk.shape[1] * qk.shape[2]:].clone()
    got = triton_kernels.rotary_(qk, positions, rope.cos, rope.sin)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, qk.shape[1] * qk.shape[2]:], v_before)  # the values beside it untouched


def check_rows_alone_as_in_a_batch(dtype, device):
    x, residual, weight = norm_inputs(dtype, device)
    out, r = triton_kernels.add_rms_norm(x, residual, weight, 1e-5)
    gate_up = torch.cat([x, residual], dim=-1)
    act = triton_kernels.silu_and_mul(gate_up)
    rope, _, qk, positions = rotary_inputs(dtype, device)
    batched = triton_kernels.rotary_(qk.clone(), positions, rope.cos, rope.sin)
    for i in range(x.shape[0]):
        one_out, one_r = triton_kernels.add_rms_norm(x[i:i + 1], residual[i:i + 1], weight, 1e-5)
        assert torch.equal(one_out[0], out[i]) and torch.equal(one_r[0], r[i])
        assert torch.equal(triton_kernels.silu_and_mul(gate_up[i:i + 1])[0], act[i])
    for i in range(qk.shape[0]):
        alone = triton_kernels.rotary_(qk[i:i + 1].clone(), positions[i:i + 1], rope.cos, rope.sin)
        assert torch.equal(alone[0], batched[i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_pytorch_path(dtype, with_residual):
    check_add_rms_norm(dtype, with_residual, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_pytorch_path(dtype):
    check_silu_and_mul(dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_the_pytorch_path_bitwise(dtype):
    check_rotary(dtype, "cpu")


def test_rotary_head_dim_not_a_power_of_two():
    rope, _, qk, positions = rotary_inputs(torch.bfloat16, head_dim=24)
    want = reference_rotary(qk.clone(), positions, rope)
    assert torch.equal(triton_kernels.rotary_(qk, positions, rope.cos, rope.sin), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_alone_as_in_a_batch(dtype):
    check_rows_alone_as_in_a_batch(dtype, "cpu")


def test_the_kernels_are_chosen_for_cuda_tensors_only(monkeypatch):
    assert triton_ops.for_tensor(torch.zeros(2)) is None  # the CPU keeps its C++ kernels or PyTorch lines

    class FakeCuda:
        is_cuda = True

    assert triton_ops.for_tensor(FakeCuda()) is (triton_kernels if triton_ops.ENABLED else None)
    monkeypatch.setattr(triton_ops, "ENABLED", False)
    assert triton_ops.for_tensor(FakeCuda()) is None  # SERVAL_TRITON_OPS=0


# ---- on CUDA: the compiled kernels, and a SmolLM2-shaped layer stack's decode step (skipped without CUDA) ----

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_on_cuda_the_kernels_match_the_pytorch_path_and_rows_stand_alone(dtype):
    for with_residual in (False, True):
        check_add_rms_norm(dtype, with_residual, "cuda")
    check_silu_and_mul(dtype, "cuda")
    check_rotary(dtype, "cuda")
    check_rows_alone_as_in_a_batch(dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 64])
@torch.inference_mode()
def test_on_cuda_a_smollm2_decode_step_runs_fewer_kernels(monkeypatch, batch):
    """Kernels of one decode step of a SmolLM2-shaped stack and its CUDA-graph replay time, with the PyTorch path
    (SERVAL_TRITON_OPS=0 and index_copy_ key/value writes: main before the kernels) and with the kernels (printed).
    The kernels' step runs fewer kernels, replays as its eager step, and keeps the PyTorch path's hidden states up to
    the norms' and silu's last-bit roundings, which 30 layers amplify (on an H200: equal at batch 1, cosine 0.99992
    per row at batch 64)."""
    from serval.layers.attention import write_kv
    from serval.layers.attention.triton_paged import TritonPagedBackend

    model, config = _smollm2_stack("cuda")
    backend = TritonPagedBackend("cuda", torch.bfloat16, 16)
    inputs = _decode_step(model, config, backend, batch)
    with monkeypatch.context() as before:
        before.setattr(triton_ops, "ENABLED", False)
        before.setattr(backend, "write_kv", lambda kc, vc, k, v, slots: (write_kv(kc, k, slots),
                                                                           write_kv(vc, v, slots)))
        kernels_before, ms_before, hidden_before = _measure(model, inputs)
    kernels_after, ms_after, hidden_after = _measure(model, inputs)
    print(f"\nSmolLM2-shaped decode step, batch {batch}, bf16, {torch.cuda.get_device_name()}: "
          f"{kernels_before} -> {kernels_after} GPU kernels a step ({kernels_before / config.num_layers:.1f} -> "
          f"{kernels_after / config.num_layers:.1f} a layer), CUDA-graph replay {ms_before:.3f} -> {ms_after:.3f} ms"
          f" ({batch / ms_before * 1e3:.0f} -> {batch / ms_after * 1e3:.0f} tok/s, forward only)")
    assert kernels_after < kernels_before
    similarity = F.cosine_similarity(hidden_before.float(), hidden_after.float(), dim=-1)
    print(f"hidden states, PyTorch path vs kernels: cosine >= {similarity.min().item():.5f}, "
          f"max |diff| {(hidden_before.float() - hidden_after.float()).abs().max().item():.4f}")
    assert similarity.min() > 0.999


def _smollm2_stack(device):
    """SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads of 64, SwiGLU 1536), random bf16 weights."""
    from serval.model.config import ModelConfig
    from serval.model.llama import LlamaForCausalLM

    config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, max_position=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    for name, p in model.named_parameters():
        p.data = (torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05).to(torch.bfloat16)
    return model.eval(), config


def _decode_step(model, config, backend, batch, context=128):
    """Inputs of one decode step of ``batch`` sequences with ``context`` tokens each, over a fresh cache."""
    from serval.layers.attention import ScheduledSequence, new_kv_cache

    blocks = -(-(context + 1) // 16)
    kv = new_kv_cache(config.num_layers, batch * blocks, 16, config.num_kv_heads, config.head_dim, torch.bfloat16,
                      "cuda")
    seqs = [ScheduledSequence(list(range(i * blocks, (i + 1) * blocks)), context, 1) for i in range(batch)]
    meta = backend.build_metadata(seqs)
    ids = torch.randint(0, config.vocab_size, (batch,), device="cuda")
    positions = torch.full((batch,), context, device="cuda")
    return ids, positions, kv, meta


def _measure(model, inputs):
    """(GPU kernels of one eager step, ms of one CUDA-graph replay, the step's hidden states)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    model(*inputs)  # compiles the kernels, probes the linears' row padding (host syncs: before any capture)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager = model(*inputs)
        torch.cuda.synchronize()
    kernels = sum(e.device_type == DeviceType.CUDA for e in prof.events())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*inputs)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # the replay computes the eager step
    return kernels, start.elapsed_time(end) / 50, eager.clone()
