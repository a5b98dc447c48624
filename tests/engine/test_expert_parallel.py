"""Mixture-of-experts models over 2 real processes (torch.distributed, gloo): with ``--enable-expert-parallel`` each
rank holds half of the experts whole, without it a slice of every expert; either way the greedy text of a batch is
one process's and the float32 logprobs stay within the tensor-parallel tolerance of it (attention's partial sums add
in another order; the experts' slots combine exactly)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from serval.config import CacheConfig, EngineConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.model.hf_config import read_hf_config
from serval.model.loader import load_model
from serval.model.parallel import TensorParallelShard
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from real_model import MODEL_PATH, requires_model  # noqa: E402
from tiny_models import save_family_dir, tiny_family  # noqa: E402

pytestmark = [requires_model, pytest.mark.timeout(600)]

# Token-id prompts, several rows per expert per step.
PROMPTS = [[(7 * i + 31 * j) % 4000 + 100 for j in range(n)] for i, n in enumerate((5, 17, 30, 9))]
# |logprob difference| of every prompt token's top 5, 2 ranks against one process, float32 (as the Llama
# tensor-parallel test's bound, tests/engine/test_tensor_parallel.py).
FLOAT32_TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    hf_tokenizer = Tokenizer.load(MODEL_PATH).hf_tokenizer
    found = {}
    for family in ("mixtral", "qwen3_moe"):
        found[family] = tmp_path_factory.mktemp(family)
        save_family_dir(found[family], family, hf_tokenizer)
    return found


def _run(directory: Path, tensor_parallel_size: int, expert_parallel: bool, check=None):
    config = EngineConfig(model=str(directory), dtype="float32", tensor_parallel_size=tensor_parallel_size,
                          enable_expert_parallel=expert_parallel,
                          cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))
    llm = LLM.from_engine(LLMEngine(config))
    try:
        if check is not None:
            check(llm.engine.core.model)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=5)
        return llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


# Qwen3-MoE under expert parallelism also has a dense layer (sliced as a Llama MLP) beside its experts.
@pytest.mark.parametrize("family,expert_parallel", [("qwen3_moe", True), ("mixtral", False)],
                         ids=["qwen3_moe-ep", "mixtral-sliced"])
def test_two_ranks_give_one_process_greedy_text(directories, family, expert_parallel):
    directory = directories[family]

    def rank0_holds_its_share(model):
        experts = model.layers[0].mlp.experts
        if expert_parallel:  # experts 0-3 of 8, whole (32 wide)
            assert experts.gate_up_proj.shape[:2] == (4, 2 * 32) and model.layers[0].mlp.first_expert == 0
        else:  # all 8, each half as wide (64 of 128)
            assert experts.gate_up_proj.shape[:2] == (8, 2 * 64)
        assert model.layers[0].mlp.group is not None

    single = _run(directory, 1, False)
    split = _run(directory, 2, expert_parallel, rank0_holds_its_share)
    worst = 0.0
    for a, b in zip(single, split):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(y.top) == list(x.top)
            worst = max(worst, abs(x.logprob - y.logprob), *(abs(x.top[k] - y.top[k]) for k in x.top))
    print(f"{family} over 2 ranks (expert parallel: {expert_parallel}): worst |logprob difference| {worst:.3g}")
    assert worst < FLOAT32_TOLERANCE
    assert len({tuple(o.outputs[0].token_ids) for o in split}) > 1  # the prompts are not all answered alike


def test_expert_parallel_needs_experts_and_enough_of_them(directories, tmp_path):
    config = read_hf_config(directories["mixtral"])
    few = dataclasses.replace(config, num_heads=4, num_kv_heads=4, num_experts=2, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="4 is more than the model's 2 experts"):
        TensorParallelShard(few, 0, 4, expert_parallel=True)
    TensorParallelShard(few, 0, 4)  # slicing each expert needs no more experts than ranks
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        tiny_family("llama").save_pretrained(tmp_path)
        load_model(tmp_path, torch.float32, expert_parallel=True)
