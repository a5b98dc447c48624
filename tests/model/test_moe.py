"""The sparse mixture-of-experts MLP (layers/moe.py) and the MoE families' loading: routing as transformers defines it
per family (Mixtral renormalizes the top-k weights, Qwen3-MoE only with ``norm_topk_prob``), a batch in which one
expert gets no token, one gets one and the others many gives transformers' block output, each row's result is the
same bits alone as in any batch, and the experts load from every form checkpoints store them in."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_llama import FP32_REL, assert_logits_close, random_ids
from tiny_models import full_logits, hf_logits, tiny_family
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from serval.config import EngineConfig
from serval.layers import cpu_kernels
from serval.layers.linear import lay_out_for_cpu_kernels
from serval.layers.moe import SparseMoE
from serval.model.hf_config import read_hf_config
from serval.model.loader import load_model

HIDDEN, WIDTH, EXPERTS = 64, 32, 4
# family -> (transformers' block, its config, whether the top-k weights are renormalized)
BLOCKS = {
    "mixtral": (MixtralSparseMoeBlock, MixtralConfig(hidden_size=HIDDEN, intermediate_size=WIDTH,
                                                     num_local_experts=EXPERTS, num_experts_per_tok=2), True),
    "qwen3_moe": (Qwen3MoeSparseMoeBlock, Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH,
                                                         num_experts=EXPERTS, num_experts_per_tok=2), False),
}


def _blocks(family: str, seed: int = 0) -> tuple[torch.nn.Module, SparseMoE]:
    """transformers' MoE block of ``family`` with random weights, and ours holding the same ones. The router sees
    only the first 4 hidden dimensions (expert e scores dimension e), so that the inputs choose the experts."""
    block_cls, config, renormalize = BLOCKS[family]
    torch.manual_seed(seed)
    theirs = block_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.gate.weight.zero_()
        theirs.gate.weight[:, :EXPERTS] = torch.eye(EXPERTS)
        theirs.experts.gate_up_proj.copy_(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) / HIDDEN**0.5)
        theirs.experts.down_proj.copy_(torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) / WIDTH**0.5)
    ours = SparseMoE(HIDDEN, WIDTH, EXPERTS, 2, renormalize)
    ours.load_state_dict({"gate.weight": theirs.gate.weight, "experts.gate_up_proj": theirs.experts.gate_up_proj,
                          "experts.down_proj": theirs.experts.down_proj})
    return theirs, ours


def _zero_one_many(rows: int = 12, seed: int = 1) -> torch.Tensor:
    """Hidden states whose first row picks experts 1 and 2 and whose others pick 2 and 3: expert 0 gets no token,
    expert 1 one, experts 2 and 3 many."""
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:, :EXPERTS] = 0
    x[0, 1], x[0, 2] = 2.0, 1.5
    x[1:, 2], x[1:, 3] = 2.0 + torch.rand(rows - 1), 1.0 + torch.rand(rows - 1)
    return x


@pytest.mark.parametrize("family", list(BLOCKS))
def test_experts_with_zero_one_and_many_tokens_give_transformers_output(family):
    theirs, ours = _blocks(family)
    x = _zero_one_many()
    weights, ids = ours.route(x)
    assert torch.bincount(ids.flatten(), minlength=EXPERTS).tolist() == [0, 1, len(x), len(x) - 1]
    # Mixtral's two weights sum to 1; Qwen3-MoE's (norm_topk_prob false) are the raw softmax's, less than 1.
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == BLOCKS[family][2]
    with torch.no_grad():
        want = theirs(x[None])[0]
    got = ours(x)
    print(f"{family}: max |ours - transformers| = {(got - want).abs().max():.3g}, scale {want.abs().max():.3g}")
    assert_logits_close(got, want, FP32_REL)


@pytest.mark.parametrize("dtype", [torch.float32, EngineConfig().torch_dtype], ids=str)
def test_a_rows_result_does_not_depend_on_the_rows_that_share_its_experts(dtype):
    """Every row alone, and the batch cut in two, give the bits of the whole batch: 40 rows spread over 4 experts
    (so each expert's matmul has a different number of rows each time)."""
    _, ours = _blocks("mixtral")
    ours = ours.to(dtype)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        whole = ours(x)
        assert len(torch.unique(ours.route(x)[1])) == EXPERTS
        assert all(torch.equal(ours(x[i: i + 1]), whole[i: i + 1]) for i in range(len(x)))
        assert torch.equal(torch.cat([ours(x[:7]), ours(x[7:])]), whole)


def test_moe_layers_and_expert_counts_from_config_json(tmp_path):
    """Qwen3-MoE's dense layers: those in ``mlp_only_layers`` and those off ``decoder_sparse_step``; older files
    name the expert count ``num_experts``; Mixtral's every layer is sparse, its experts ``intermediate_size`` wide."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps({
        **base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True}))
    cfg = read_hf_config(tmp_path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 16, 4)
    assert (cfg.moe_layers, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.qk_norm) == ([1, 5], 32, True, True)
    (tmp_path / "config.json").write_text(json.dumps({**base, "architectures": ["MixtralForCausalLM"],
                                                      "num_local_experts": 8}))
    cfg = read_hf_config(tmp_path)
    assert (cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok) == (list(range(6)), 8, 2)
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.qk_norm) == (128, True, False)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_stored_stacked_load_as_per_expert_tensors(family, tmp_path):
    """transformers 5's modules hold each layer's experts stacked (``mlp.experts.gate_up_proj`` [experts,
    2 * width, hidden]); its save_pretrained writes them per expert (Mixtral's under ``block_sparse_moe.experts.{i}
    .w1/w2/w3``, tests/model/test_families.py). A file with the stacked tensors, as a state_dict saved directly holds
    them, gives the same model."""
    overrides = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
                 "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}}
    hf = tiny_family(family, **overrides[family])
    hf.save_pretrained(tmp_path)
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3 for name, t in state.items())
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    save_file(state, tmp_path / "model.safetensors")
    ids = random_ids(24, seed=3)
    assert_logits_close(full_logits(load_model(tmp_path, torch.float32), ids), hf_logits(hf, ids), FP32_REL)


class _Ranks:
    """A stand-in for a ParallelGroup of two ranks: the first pass records each rank's expert slots, after which
    ``all_reduce`` returns their float32 sum, as gloo's all-reduce of two tensors does."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.slots) < 2:
            self.slots.append(x.clone())
            return x
        return self.slots[0] + self.slots[1]


@pytest.mark.parametrize("dtype", [torch.float32, EngineConfig().torch_dtype], ids=str)
def test_expert_parallel_ranks_combine_to_one_process_bits(dtype):
    """Two ranks holding experts 0-1 and 2-3 each fill only their experts' slots (the rest stay zero), and the sum
    over ranks, added slot by slot, is bitwise the one-process output: every sum is x + 0."""
    _, whole = _blocks("mixtral")
    whole = whole.to(dtype)
    ranks = [SparseMoE(HIDDEN, WIDTH, EXPERTS, 2, True, local_experts=(r * 2, r * 2 + 2)).to(dtype) for r in (0, 1)]
    group = _Ranks()
    for r, rank in enumerate(ranks):
        rank.gate.weight.copy_(whole.gate.weight)
        rank.experts.gate_up_proj.copy_(whole.experts.gate_up_proj[r * 2: r * 2 + 2])
        rank.experts.down_proj.copy_(whole.experts.down_proj[r * 2: r * 2 + 2])
        rank.group = group
    x = _zero_one_many(rows=20).to(dtype)
    with torch.inference_mode():
        for rank in ranks:
            rank(x)  # records the rank's slots
        assert all(s.abs().sum(-1).count_nonzero() < len(s) for s in group.slots)  # each filled only its share
        combined = [rank(x) for rank in ranks]
        assert torch.equal(combined[0], whole(x)) and torch.equal(combined[1], combined[0])


@pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.load().block_panel_kernel_available(),
                    reason="the dense kernel needs the C++ kernels and AVX2 (FMA, F16C) or AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, EngineConfig().torch_dtype], ids=str)
def test_experts_laid_out_for_the_cpu_kernel_multiply_their_rows_alone(dtype):
    """As load_model lays them out on the CPU (layers/linear.py ``lay_out_for_cpu_kernels``), the experts multiply
    exactly their routed rows with the dense kernel, unpadded: zero, one and many tokens per expert give
    transformers' output (float32), a row alone gives the batch's bits, and two expert-parallel ranks combine to
    one process's bits."""
    theirs, whole = _blocks("mixtral")
    whole = whole.to(dtype)
    group = _Ranks()
    ranks = [SparseMoE(HIDDEN, WIDTH, EXPERTS, 2, True, local_experts=(r * 2, r * 2 + 2)).to(dtype) for r in (0, 1)]
    for r, rank in enumerate(ranks):
        rank.gate.weight.copy_(whole.gate.weight)
        rank.experts.gate_up_proj.copy_(whole.experts.gate_up_proj[r * 2: r * 2 + 2])
        rank.experts.down_proj.copy_(whole.experts.down_proj[r * 2: r * 2 + 2])
        rank.group = group
    for moe in (whole, *ranks):
        # the router (bfloat16 on the kernel too, whatever the CPU), the stacked gate/up and down
        assert lay_out_for_cpu_kernels(moe, bfloat16_linears=True) == 3
    x = _zero_one_many(rows=20).to(dtype)
    with torch.inference_mode():
        got = whole(x)
        assert whole.experts.min_rows == (1, 1) and whole.experts.gate_up_proj.transpose(1, 2).is_contiguous()
        assert all(torch.equal(whole(x[i: i + 1]), got[i: i + 1]) for i in range(len(x)))
        if dtype == torch.float32:
            assert_logits_close(got, theirs(x[None])[0], FP32_REL)
        for rank in ranks:
            rank(x)  # records the rank's slots
        combined = [rank(x) for rank in ranks]
        assert torch.equal(combined[0], got) and torch.equal(combined[1], got)
