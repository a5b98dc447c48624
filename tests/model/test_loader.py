"""load_model's annotation says what it returns: every architecture it builds, and a pipeline stage's wrapper; it
refuses a directory it cannot run with an error that says why."""

from __future__ import annotations

import json
import typing

import pytest
import torch

from serval.model import loader
from serval.model.hf_config import read_hf_config
from serval.model.parallel import PipelineStage


def test_load_model_is_annotated_with_every_type_it_returns():
    returned = set(typing.get_args(typing.get_type_hints(loader.load_model)["return"]))
    assert set(loader._MODEL_CLASSES.values()) | {PipelineStage} == returned


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match="'GPTNeoXForCausalLM' is not supported") as refused:
        loader.load_model(tmp_path, torch.float32)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
                 "Gemma2ForCausalLM"):
        assert name in str(refused.value)


def test_an_output_projection_bias_is_refused(tmp_path):
    """Llama's and Qwen3's attention_bias also biases o_proj, which the decoder lacks: refused, not ignored."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias is not supported for LlamaForCausalLM"):
        loader.load_model(tmp_path, torch.float32)


SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4}


@pytest.mark.parametrize(("written", "layer_types"), [
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 32768}, None),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     ["full_attention", "sliding_attention", "sliding_attention"]),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8},
     ["full_attention"] * 3),  # transformers' max_window_layers default, 28, is past the last layer
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8}, ["sliding_attention"] * 3),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),
    ({"architectures": ["Phi3ForCausalLM"], "sliding_window": 8}, ["sliding_attention"] * 3),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8},
     ["sliding_attention", "full_attention", "sliding_attention"]),
], ids=["qwen2-off", "qwen2-from-layer-1", "qwen3-default-max-window-layers", "mistral", "mistral-none", "phi3",
        "gemma2-alternating"])
def test_sliding_layers_from_a_config_json_without_layer_types(tmp_path, written, layer_types):
    """config.json files that transformers 4 wrote (most checkpoints on disk) carry no ``layer_types``: Qwen's
    use_sliding_window / max_window_layers and Mistral's sliding_window give the same list transformers derives."""
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **written}))
    config = read_hf_config(tmp_path)
    assert config.layer_types == layer_types
    assert config.sliding_window == (8 if layer_types else None)


def test_phi3s_older_longrope_form_and_gemma2s_defaults(tmp_path):
    """Phi-3 files written before transformers 5 name LongRoPE "su" (or "longrope") in ``rope_scaling`` and keep the
    original context beside it: read as one "longrope" dict. A Gemma 2 config.json that leaves out the caps, the
    window and the tying gets transformers' defaults."""
    factors = [1.0] * 8
    (tmp_path / "config.json").write_text(json.dumps({
        **SHAPE, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "su", "short_factor": factors, "long_factor": factors}}))
    assert read_hf_config(tmp_path).rope_scaling == {"type": "su", "rope_type": "longrope", "short_factor": factors,
                                                     "long_factor": factors, "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "architectures": ["Gemma2ForCausalLM"]}))
    config = read_hf_config(tmp_path)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.sliding_window) == (50.0, 30.0, 4096)
    assert config.tie_word_embeddings and not config.qk_norm and config.layer_types[:2] == ["sliding_attention",
                                                                                           "full_attention"]


def test_a_partial_rotary_factor_is_refused(tmp_path):
    """Phi-4-mini's Phi3ForCausalLM rotates three quarters of each head; RoPE here rotates whole heads."""
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "architectures": ["Phi3ForCausalLM"],
                                                      "partial_rotary_factor": 0.75}))
    with pytest.raises(ValueError, match="partial_rotary_factor is not supported"):
        read_hf_config(tmp_path)


def test_a_models_dense_embedding_draws_nn_embeddings_values():
    from torch import nn

    from serval.layers.embedding import dense_embedding

    torch.manual_seed(3)
    want = nn.Embedding(100, 8).weight
    torch.manual_seed(3)
    got = dense_embedding(100, 8).weight
    assert torch.equal(got, want) and not got.requires_grad


def test_a_load_imports_no_compiler_modules():
    """A load builds its model on the meta device, then makes its tensors; torch._dynamo (1.7 s to import) and
    torch.fx's symbolic shapes (0.3 s), which the meta device's forms of some ops import, are no part of serving;
    nor is the gguf package (0.1 s) for a file whose tensors are blocks and plain floats."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, torch\n"
            "from serval.model.config import ModelConfig\n"
            "from serval.model.gemma3 import Gemma3ForCausalLM\n"
            "from serval.model.loader import load_model\n"
            "from serval.model.registry import resolve_model_path\n"
            "config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,"
            " num_kv_heads=1, head_dim=16, max_position=64, architecture='gemma3')\n"
            "with torch.device('meta'):\n"
            "    Gemma3ForCausalLM(config)\n"
            "load_model(resolve_model_path(None), torch.bfloat16)\n"
            "print([m for m in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes', 'gguf')"
            " if m in sys.modules])\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert out.stdout.strip() == "[]", out.stderr
