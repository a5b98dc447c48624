"""The fused CPU ops (csrc/fused_ops.cpp): residual add + RMSNorm, RoPE in place, silu(gate) * up and the rows'
argmax, against the PyTorch lines they replace, and each row the same alone or in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serval.layers import cpu_kernels
from serval.layers.activation import exact_gelu_lanes, gelu_tanh_and_mul, silu_and_mul
from serval.layers.norm import GemmaRMSNorm, RMSNorm, exact_sum_lanes
from serval.layers.rotary import RotaryEmbedding

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16]


def reference_norm(x, residual, weight, eps):
    r = x if residual is None else x + residual
    return weight * F.rms_norm(r.float(), weight.shape, eps=eps).to(r.dtype), r


def ulps(dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_pytorch_path(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    residual = (torch.randn(37, 576, generator=g) * 10).to(dtype) if with_residual else None
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    out, r = kernels.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_r = reference_norm(x, residual, weight, 1e-5)
    assert torch.equal(r, want_r)  # the residual stream: the same rounded add
    # The norm's sum runs in another order: at most one rounding step of the dtype apart, relative to each value.
    assert torch.all((out.float() - want_out.float()).abs() <= 2 * ulps(dtype) * want_out.float().abs() + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_uses_the_kernel_and_falls_back(monkeypatch, dtype):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 64).to(dtype)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    fused = norm(x, residual)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    plain = norm(x, residual)
    assert torch.equal(fused[1], plain[1])
    assert torch.allclose(fused[0].float(), plain[0].float(), rtol=2 * ulps(dtype), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_the_pytorch_path(dtype):
    """Queries and keys as the model passes them: a [T, heads, D] view into the wider qkv output."""
    rope = RotaryEmbedding(64, 512, 10000.0)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(23, 20 * 64, generator=g).to(dtype)
    positions = torch.randint(0, 512, (23,), generator=g)
    qk = qkv[:, : 16 * 64].view(23, 16, 64)
    cos = rope.cos[positions].unsqueeze(1).to(dtype)
    sin = rope.sin[positions].unsqueeze(1).to(dtype)
    want = RotaryEmbedding.apply(qk, cos, sin)
    untouched = qkv[:, 16 * 64:].clone()
    kernels.rotary_embedding_(qk, positions, rope.cos, rope.sin)
    if dtype == torch.bfloat16:
        assert torch.equal(qk, want)  # every product and the sum rounded where PyTorch rounds them
    else:  # float32: the compiler may fuse the last multiply-add
        assert torch.allclose(qk, want, rtol=2 * ulps(dtype), atol=1e-6)
    assert torch.equal(qkv[:, 16 * 64:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_alone_or_in_a_batch(dtype):
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(40, 576, generator=g).to(dtype), torch.randn(40, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype)
    batch = kernels.add_rms_norm(x, residual, weight, 1e-5)[0]
    alone = torch.cat([kernels.add_rms_norm(x[i: i + 1], residual[i: i + 1], weight, 1e-5)[0] for i in range(40)])
    assert torch.equal(batch, alone)
    rope = RotaryEmbedding(64, 128, 10000.0)
    q = torch.randn(40, 9, 64, generator=g).to(dtype)
    positions = torch.arange(40) * 3
    together = q.clone()
    kernels.rotary_embedding_(together, positions, rope.cos, rope.sin)
    for i in range(40):
        one = q[i: i + 1].clone()
        kernels.rotary_embedding_(one, positions[i: i + 1], rope.cos, rope.sin)
        assert torch.equal(one, together[i: i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])  # 40: a row that ends inside a vector
def test_silu_and_mul_is_the_pytorch_lines(dtype, width):
    """silu(gate) * up for x = [gate | up], rounded where PyTorch rounds; its exp is the kernels' own (within 2 ulp
    of float32), so a float32 result may differ from torch's in the last bits, a bfloat16 one almost never."""
    x = torch.randn(37, 2 * width, generator=torch.Generator().manual_seed(0)).mul_(4).to(dtype)
    got = kernels.silu_and_mul(x)
    want = F.silu(x[:, :width]) * x[:, width:]
    assert got.dtype == dtype and got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= 4 * ulps(dtype) * want.float().abs() + 1e-30).all()
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.99
    rows = torch.cat([kernels.silu_and_mul(x[i: i + 1]) for i in range(len(x))])
    assert torch.equal(rows, got)
    assert torch.equal(silu_and_mul(x.view(1, 37, -1)), got.view(1, 37, -1))  # the layer the MLP calls


def test_argmax_rows_is_torch_argmax_with_ties_and_nans():
    """The first index of each row's largest value, as torch.argmax: ties go to the first, a NaN wins (the first
    NaN), and every row length's tail (shorter than a vector, or not a multiple of one)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 49152, generator=gen)
    x[1, [40, 4000, 40000]] = 100.0  # a three-way tie
    x[2, [70, 9]] = float("nan")
    x[3, 0] = float("nan")
    x[4, -1] = 1000.0
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))
    assert kernels.argmax_rows(x)[1] == 40 and kernels.argmax_rows(x)[2] == 9
    for n in (1, 5, 16, 17, 33, 47):
        y = torch.randn(3, n, generator=gen)
        assert torch.equal(kernels.argmax_rows(y), y.argmax(-1)), n


# --- Gemma: its RMSNorm, x / rms(x) * (1 + w) in float32 (alone, per head, and added into the residual stream and
# normed again in one call), and GeGLU's gelu_tanh(gate) * up: the PyTorch lines' bits ---

TORCH_LANES = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())


def gemma_norm(size, dtype, seed=3) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(size, 1e-6).to(dtype)
    norm.weight.copy_(0.3 * torch.randn(size, generator=torch.Generator().manual_seed(seed)))
    return norm


def gemma_rows(rows, size, dtype, seed=4, scale=3.0):
    return (torch.randn(rows, size, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [640, 256, 1152, 100])  # Gemma 3 270M's width and head; 1B's width; a ragged one
def test_gemma_rms_norm_is_the_pytorch_lines_bitwise(dtype, size):
    """The C++ norm adds the squares in PyTorch's order (its float vectors, 4 accumulators, cascaded blocks), so on
    rows of every scale it gives the PyTorch lines' bits."""
    norm = gemma_norm(size, dtype)
    assert exact_sum_lanes(kernels, size, dtype) is not None or TORCH_LANES is None
    assert norm._kernel(gemma_rows(1, size, dtype)) is not None or TORCH_LANES is None
    for seed, scale in ((4, 3.0), (5, 1e-3), (6, 500.0)):
        x = gemma_rows(45, size, dtype, seed, scale) * torch.logspace(-2, 2, 45)[:, None].to(dtype)
        assert torch.equal(norm(x), norm.reference(x))
        assert torch.equal(norm(x[7:8]), norm.reference(x[7:8]))  # one row: the decode step's


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_of_each_head_inside_the_qkv_output_is_the_pytorch_lines_bitwise(dtype):
    """Queries and keys as Gemma 3's attention passes them: [T, heads, 256] views into qkv, each head normed alone."""
    qkv = gemma_rows(9, (4 + 1 + 1) * 256, dtype, seed=7, scale=2.0)
    q, k = qkv[:, :4 * 256].view(9, 4, 256), qkv[:, 4 * 256:5 * 256].view(9, 1, 256)
    for heads in (q, k):
        norm = gemma_norm(256, dtype, seed=8)
        out = norm(heads)
        assert out.shape == heads.shape and out.is_contiguous()
        assert torch.equal(out, norm.reference(heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_add_and_norm_again_is_the_pytorch_lines_bitwise(dtype):
    """post_norm(x) added into the residual stream and the next pre-norm of it, in one call: the PyTorch lines'
    residual + post_norm(x) and pre_norm of that sum, bit for bit."""
    post, pre = gemma_norm(640, dtype, seed=9), gemma_norm(640, dtype, seed=10)
    x = gemma_rows(37, 640, dtype, seed=11, scale=30.0)
    residual = gemma_rows(37, 640, dtype, seed=12, scale=10.0)
    out, r = post.add_to(x, residual, pre)
    want_r = residual + post.reference(x)
    assert torch.equal(r, want_r) and torch.equal(out, pre.reference(want_r))
    lanes = exact_sum_lanes(kernels, 640, dtype)
    only_r, same = kernels.gemma_rms_norm(x, post.weight, 1e-6, lanes, residual)  # no next norm: (r, r)
    assert torch.equal(only_r, r) and same is only_r


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_and_geglu_rows_are_the_same_alone_or_in_a_batch(dtype):
    x, residual = gemma_rows(33, 640, dtype, seed=3), gemma_rows(33, 640, dtype, seed=13, scale=10.0)
    weight, next_weight = gemma_norm(640, dtype, seed=14).weight, gemma_norm(640, dtype, seed=15).weight
    lanes = exact_sum_lanes(kernels, 640, dtype) or 16
    batch = kernels.gemma_rms_norm(x, weight, 1e-6, lanes, residual, next_weight)
    heads = kernels.gemma_rms_norm(x.view(33, 20, 32), weight[:32].contiguous(), 1e-6, lanes)[0]
    gate_up = torch.cat([x, residual], dim=1)
    geglu = kernels.gelu_tanh_and_mul(gate_up, lanes)
    for row in (0, 17, 32):
        alone = kernels.gemma_rms_norm(x[row:row + 1], weight, 1e-6, lanes, residual[row:row + 1], next_weight)
        assert torch.equal(alone[0][0], batch[0][row]) and torch.equal(alone[1][0], batch[1][row])
        assert torch.equal(kernels.gemma_rms_norm(x[row:row + 1], weight, 1e-6, lanes)[0][0],
                           kernels.gemma_rms_norm(x, weight, 1e-6, lanes)[0][row])
        head = kernels.gemma_rms_norm(x[row:row + 1].view(1, 20, 32), weight[:32].contiguous(), 1e-6, lanes)[0]
        assert torch.equal(head[0], heads[row])
        assert torch.equal(kernels.gelu_tanh_and_mul(gate_up[row:row + 1], lanes)[0], geglu[row])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2048, 2050, 40])  # Gemma 3 270M's; past PyTorch's last pair of vectors
def test_gelu_tanh_and_mul_is_the_pytorch_lines_bitwise(dtype, width):
    """SLEEF's tanh in vectors and libm's past the last pair of vectors, as PyTorch's loop takes them, and its one
    FMA in x + 0.044715 x^3: the bits of F.gelu(gate, approximate="tanh") * up."""
    g = torch.Generator().manual_seed(width)
    gate = torch.randn(13, width, generator=g) * 4
    gate[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e20, -1e20])
    gate_up = torch.cat([gate, torch.randn(13, width, generator=g)], dim=1).to(dtype)
    assert exact_gelu_lanes(kernels, width, dtype) == TORCH_LANES or TORCH_LANES is None
    want = F.gelu(gate_up[:, :width], approximate="tanh") * gate_up[:, width:]
    assert torch.equal(gelu_tanh_and_mul(gate_up), want)
    assert torch.equal(gelu_tanh_and_mul(gate_up[4:5]), want[4:5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_layers_take_the_kernels_on_the_cpu_and_give_the_pytorch_lines_bits(monkeypatch, dtype):
    """A Gemma 3 model (per-head q/k norms, GeGLU) runs no PyTorch norm or gelu on the CPU, and with the PyTorch
    lines for them instead (every other kernel the same) it gives the same logits bit for bit."""
    from tiny_models import full_logits

    from serval.layers import activation, norm
    from serval.model.config import ModelConfig
    from serval.model.gemma3 import Gemma3ForCausalLM

    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position=64, rms_norm_eps=1e-6, architecture="gemma3",
                         layer_types=["sliding_attention", "full_attention"], sliding_window=4, qk_norm=True,
                         rope_local_theta=10000.0, query_pre_attn_scalar=16)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
            param.data = param.data.to(dtype)  # the weights in the dtype; the rotary tables stay float32
    ids = list(range(3, 30))
    first = full_logits(model, ids)  # finds the kernels' exact widths (runs the PyTorch lines once to compare)

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch path ran on the CPU")

    with monkeypatch.context() as patch:
        patch.setattr(F, "rms_norm", refuse)
        patch.setattr(F, "gelu", refuse)
        fused = full_logits(model, ids)
    monkeypatch.setattr(norm, "exact_sum_lanes", lambda *args: None)
    monkeypatch.setattr(activation, "exact_gelu_lanes", lambda *args: None)
    plain = full_logits(model, ids)
    assert torch.equal(fused, first) and torch.equal(fused, plain)
