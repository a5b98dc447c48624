"""A model's sampling defaults: read from generation_config.json or GGUF general.sampling.*, an embedded model's
preset where its file has none, --generation-config vllm|DIR, the override on top, and a request's values over all."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from serval.config import EngineConfig
from serval.model.registry import resolve_model_path
from serval.model.sampling_defaults import read_generation_config, read_gguf_sampling, resolve_sampling_defaults
from serval.server.protocol import ChatCompletionRequest, CompletionRequest

HF_VALUES = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
GGUF_VALUES = {"temperature": 0.7, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.05}
SMOLLM2_PRESET = {"temperature": 0.2, "top_p": 0.9}
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def hf_dir(path: Path, generation_config: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def gguf_file(path: Path, sampling: dict | None) -> Path:
    """A GGUF with a header (and one small tensor) and, if given, llama.cpp's general.sampling keys."""
    writer = gguf.GGUFWriter(str(path), "llama")
    keys = gguf.Keys.General
    if sampling:
        writer.add_float32(keys.SAMPLING_TEMP, sampling["temperature"])
        writer.add_float32(keys.SAMPLING_TOP_P, sampling["top_p"])
        writer.add_int32(keys.SAMPLING_TOP_K, sampling["top_k"])
        writer.add_float32(keys.SAMPLING_MIN_P, sampling["min_p"])
        writer.add_float32(keys.SAMPLING_PENALTY_REPEAT, sampling["repetition_penalty"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_hugging_face_directory_gives_its_generation_config(tmp_path):
    directory = hf_dir(tmp_path / "model", {**HF_VALUES, "do_sample": True, "max_new_tokens": 512, "eos_token_id": 2})
    assert read_generation_config(directory) == HF_VALUES  # the sampling fields only
    defaults = resolve_sampling_defaults(str(directory), directory)
    assert defaults.values == HF_VALUES
    assert defaults.source.endswith("generation_config.json")


def test_a_gguf_file_gives_its_general_sampling_keys(tmp_path):
    path = gguf_file(tmp_path / "m.gguf", GGUF_VALUES)
    assert read_gguf_sampling(path) == GGUF_VALUES  # float32 in the file, the written values back
    assert resolve_sampling_defaults(str(path), path).values == GGUF_VALUES


def test_a_model_without_defaults_gets_none(tmp_path):
    bare = hf_dir(tmp_path / "bare", None)
    assert resolve_sampling_defaults(str(bare), bare).values == {}
    path = gguf_file(tmp_path / "plain.gguf", None)
    defaults = resolve_sampling_defaults(str(path), path)
    assert defaults.values == {}
    assert "none" in defaults.source


def test_each_embedded_model_has_a_documented_preset():
    smollm2 = resolve_sampling_defaults(None, resolve_model_path(None))  # the default model: its file has no keys
    assert smollm2.values == SMOLLM2_PRESET
    assert "preset for smollm2-135m-instruct" in smollm2.source


def test_the_gemma3_preset_is_its_generation_config(tmp_path):
    # gemma3-270m's file need not be joined for this: its preset applies to any file of that name with no keys.
    defaults = resolve_sampling_defaults("gemma3-270m", gguf_file(tmp_path / "g.gguf", None))
    assert defaults.values == {"temperature": 1.0, "top_k": 64, "top_p": 0.95}


def test_a_files_own_values_win_over_the_preset(tmp_path):
    path = gguf_file(tmp_path / "m.gguf", GGUF_VALUES)
    assert resolve_sampling_defaults("smollm2-135m-instruct", path).values == GGUF_VALUES


def test_generation_config_vllm_is_none_and_dir_reads_that_folder(tmp_path):
    model = resolve_model_path(None)
    assert resolve_sampling_defaults(None, model, "vllm").values == {}
    other = hf_dir(tmp_path / "other", {"temperature": 0.3})
    assert resolve_sampling_defaults(None, model, str(other)).values == {"temperature": 0.3}
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        resolve_sampling_defaults(None, model, str(tmp_path / "nowhere"))


def test_the_override_goes_on_top():
    model = resolve_model_path(None)
    defaults = resolve_sampling_defaults(None, model, override={"temperature": 0, "top_k": 5})
    assert defaults.values == {"temperature": 0.0, "top_p": 0.9, "top_k": 5}
    assert "override" in defaults.source
    assert resolve_sampling_defaults(None, model, "vllm", {"min_p": 0.1}).values == {"min_p": 0.1}


def test_bad_defaults_are_refused_naming_where_they_came_from(tmp_path):
    with pytest.raises(ValueError, match="unknown fields \\['max_tokens'\\]"):
        EngineConfig(override_generation_config={"max_tokens": 5})
    with pytest.raises(ValueError, match="top_p"):
        EngineConfig(override_generation_config={"top_p": 0})
    with pytest.raises(ValueError, match="top_k must be an integer"):
        EngineConfig(override_generation_config={"top_k": 2.5})
    directory = hf_dir(tmp_path / "bad", {"temperature": -1})
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        resolve_sampling_defaults(str(directory), directory)


def test_a_requests_explicit_values_win_then_the_models_then_openais():
    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    hi = [{"role": "user", "content": "hi"}]
    left_out = ChatCompletionRequest(messages=hi).sampling_params(None, None, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.repetition_penalty, left_out.top_k) == (0.2, 0.9, 1.1, 0)
    explicit = ChatCompletionRequest(messages=hi, temperature=1.0, top_k=7).sampling_params(None, None, defaults)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 0.9, 7)
    greedy = CompletionRequest(prompt="hi", temperature=0).sampling_params(16, None, defaults)
    assert greedy.temperature == 0.0  # 0 is a value given, not "left out"
    no_model_defaults = CompletionRequest(prompt="hi").sampling_params(16, None, {})
    assert {k: getattr(no_model_defaults, k) for k in OPENAI} == OPENAI
