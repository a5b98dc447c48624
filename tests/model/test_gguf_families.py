"""Qwen2, Qwen3, Mistral, Phi-3 and Gemma 2 from GGUF files written as llama.cpp's converter writes them
(tiny_models.write_gguf: architectures qwen2, qwen3, phi3, gemma2, and llama for Mistral; llama.cpp's tensor names;
q/k rows permuted for llama only; Phi-3's fused q/k/v and gate/up and its LongRoPE factors as tensors; Gemma 2's
norms as 1 + w, caps and window in the header; the embedded SmolLM2's tokenizer and chat template in the header):
float32 logits equal transformers' on the weights the file holds, and greedy chat text equals transformers' generate.

llama.cpp's converter writes no sliding window for MistralForCausalLM (nor for Qwen2's), and llama.cpp then attends
to every key: the Mistral here has a window of 8 keys in its config.json, and its GGUF file runs as transformers runs
the same weights without one. Phi-3's and Gemma 2's files keep their windows, and each runs with it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from real_model import MODEL_PATH, requires_model
from test_families import LONG, _llm, assert_chats_equal_generate
from test_llama import FP32_REL, assert_logits_close
from tiny_models import full_logits, gguf_tokenizer_fields, hf_logits, tiny_family, write_gguf

from serval.layers.linear import BlockQuantLinear
from serval.model.gguf_file import GGUFModelFile
from serval.model.loader import load_model
from serval.tokenizer import Tokenizer

pytestmark = requires_model  # the tokenizer fields are the embedded SmolLM2's

# What sets each family apart, switched on: Qwen3's head_dim wider than hidden / heads (as in Qwen3-0.6B), so the
# file carries attention.key_length; Mistral's window, which the file drops; Phi-3's window, which it keeps; Gemma 2's
# window, binding caps and narrow heads, its head tied (the converter writes none) to embeddings small enough that
# greedy text does not only repeat a token, and its attention scaled by the head size (the header has no
# query_pre_attn_scalar: llama.cpp assumes it).
FAMILIES = {"qwen2": {}, "qwen3": {"head_dim": 32}, "mistral": {"sliding_window": 8}, "phi3": {"sliding_window": 8},
            "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0,
                       "final_logit_softcapping": 8.0, "tie_word_embeddings": True}}
GGUF_ARCHITECTURE = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "phi3": "phi3", "gemma2": "gemma2"}
WINDOWS = {"phi3": [8, 8, 8], "gemma2": [8, None, 8]}  # the others: none


@pytest.fixture(scope="module")
def tokenizer_fields() -> list[tuple]:
    return gguf_tokenizer_fields(MODEL_PATH)


def _tiny(name: str, **overrides) -> torch.nn.Module:
    # SmolLM2's vocabulary and special ids, so that the copied tokenizer fits.
    model = tiny_family(name, num_hidden_layers=3, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                        **{**FAMILIES[name], **overrides})
    if name == "gemma2":
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.125)
    return model


def _reference(name: str, stored: dict) -> torch.nn.Module:
    """transformers' model of ``name`` on the weights the file holds, without a sliding window (none is in the
    file)."""
    ref = _tiny(name, sliding_window=None) if name == "mistral" else _tiny(name)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    return ref


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize(("qtype", "quantization"), [("F32", "none"), ("F16", "none"), ("Q8_0", "gguf")],
                         ids=["F32", "F16", "Q8_0-in-place"])
def test_fp32_logits_match_transformers(tmp_path: Path, name: str, qtype: str, quantization: str) -> None:
    path = tmp_path / f"{name}.gguf"
    stored = write_gguf(path, _tiny(name), qtype)
    ours = load_model(path, torch.float32, quantization=quantization)
    config = ours.config
    assert (config.architecture, config.qkv_bias, config.qk_norm) == (GGUF_ARCHITECTURE[name], name == "qwen2",
                                                                       name == "qwen3")
    assert [layer.self_attn.window for layer in ours.layers] == WINDOWS.get(name, [None] * 3)
    if quantization == "gguf":  # every linear reads the file's Q8_0 blocks, the biases and norms beside them
        assert sum(isinstance(m, BlockQuantLinear) for m in ours.modules()) == 4 * config.num_layers + 1
    want = hf_logits(_reference(name, stored), LONG)
    got = full_logits(ours, LONG)
    print(f"{name} {qtype}: max |ours - transformers| = {(got - want).abs().max():.3g}, logit scale "
          f"{want.abs().max():.3g}")
    assert_logits_close(got, want, FP32_REL)


def test_qwen_query_rows_load_as_stored(tmp_path: Path) -> None:
    """llama.cpp permutes q/k rows for arch llama only: a qwen2 file's rows are the model's as stored."""
    stored = write_gguf(tmp_path / "qwen2.gguf", _tiny("qwen2"), "F32")
    ours = load_model(tmp_path / "qwen2.gguf", torch.float32, quantization="none")
    q_rows = ours.config.num_heads * ours.config.head_dim
    loaded_q = ours.layers[0].self_attn.qkv_proj.weight[:q_rows]
    assert torch.equal(loaded_q, torch.from_numpy(stored["model.layers.0.self_attn.q_proj.weight"]))


def test_yarn_rope_scaling_is_refused(tmp_path: Path) -> None:
    """llama.cpp writes long-context Qwen2 files with YaRN, which the rotary embedding lacks: refused, not dropped."""
    writer = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "qwen2")
    for add, value in [(writer.add_embedding_length, 64), (writer.add_head_count, 4), (writer.add_vocab_size, 256),
                       (writer.add_feed_forward_length, 128), (writer.add_block_count, 1),
                       (writer.add_context_length, 256), (writer.add_rope_scaling_factor, 4.0)]:
        add(value)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        GGUFModelFile(tmp_path / "yarn.gguf").model_config()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_chat_equals_transformers_generate(tmp_path: Path, tokenizer_fields: list[tuple], name: str) -> None:
    """The tokenizer and chat template come from the file's own header; the Q8_0 blocks are read in place."""
    path = tmp_path / f"{name}.gguf"
    stored = write_gguf(path, _tiny(name), "Q8_0", tokenizer=tokenizer_fields)
    hf, tokenizer = _reference(name, stored), Tokenizer.load(path)
    assert "<|im_start|>" in tokenizer.chat_template
    assert_chats_equal_generate(_llm(path, load_model(path, torch.float32), tokenizer), hf, tokenizer)


def test_phi3_longrope_from_its_factor_tensors(tmp_path: Path) -> None:
    """Phi-3's LongRoPE as llama.cpp writes it (rope_factors_long/short tensors, the original context and attention
    factor in the header; original context 64 of 256): a 60-token prompt's logits are transformers', and over 80
    tokens, past the original context, the file's logits are those of the same weights from safetensors (whose
    LongRoPE test_families.py checks against transformers there too)."""
    gen = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
            "long_factor": (4 + 12 * torch.rand(8, generator=gen)).tolist()}
    hf = _tiny("phi3", rope_parameters=rope, original_max_position_embeddings=64, max_position_embeddings=256)
    write_gguf(tmp_path / "phi3.gguf", hf, "F32")
    hf.save_pretrained(tmp_path / "dir", safe_serialization=True)
    ours, from_dir = load_model(tmp_path / "phi3.gguf", torch.float32), load_model(tmp_path / "dir", torch.float32)
    scaling = ours.config.rope_scaling
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"]) == ("longrope", 64)
    assert scaling["long_factor"] == pytest.approx(rope["long_factor"], rel=1e-6)
    assert scaling["short_factor"] == pytest.approx(rope["short_factor"], rel=1e-6)
    prompt = LONG[:60]
    assert_logits_close(full_logits(ours, prompt), hf_logits(hf, prompt), FP32_REL)
    assert_logits_close(full_logits(ours, LONG), full_logits(from_dir, LONG), FP32_REL)


# Mixtral (written as "llama", no window) and Qwen3-MoE ("qwen3moe"), 8 experts of which each token takes 2, with the
# weights renormalized as llama.cpp renormalizes both families; every layer sparse, as the converter writes them.
MOE_FAMILIES = {"mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
                "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "norm_topk_prob": True}}


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
@pytest.mark.parametrize(("qtype", "quantization"), [("F32", "none"), ("Q8_0", "gguf")], ids=["F32", "Q8_0"])
def test_moe_file_logits_match_transformers(tmp_path: Path, name: str, qtype: str, quantization: str) -> None:
    """The router and the stacked experts (ffn_gate_inp, ffn_{gate,up,down}_exps) load as each expert's matrices;
    the attention's Q8_0 blocks are read in place, the experts dequantized, the router kept dense."""
    hf = tiny_family(name, num_hidden_layers=3, **MOE_FAMILIES[name])
    path = tmp_path / f"{name}.gguf"
    stored = write_gguf(path, hf, qtype)
    ours = load_model(path, torch.float32, quantization=quantization)
    config = ours.config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok, config.moe_layers,
            config.norm_topk_prob) == (name, 8, 2, [0, 1, 2], True)
    assert config.moe_intermediate_size == (32 if name == "qwen3_moe" else 128)
    if quantization == "gguf":  # q/k/v, o and the head in blocks; the routers stay dense
        assert sum(isinstance(m, BlockQuantLinear) for m in ours.modules()) == 2 * config.num_layers + 1
        assert not any(isinstance(layer.mlp.gate, BlockQuantLinear) for layer in ours.layers)
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    want, got = hf_logits(hf, LONG), full_logits(ours, LONG)
    print(f"{name} {qtype}: max |ours - transformers| = {(got - want).abs().max():.3g}, logit scale "
          f"{want.abs().max():.3g}")
    assert_logits_close(got, want, FP32_REL)
