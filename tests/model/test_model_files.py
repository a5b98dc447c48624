"""A bad model fails before it loads, with one line naming the file and what is wrong with it (ModelFileError): an
empty file, a GGUF or safetensors file cut short, a header that does not parse, an architecture Serval does not run,
a model without a tokenizer. Through the command line (`generate` and `serve`): that one line, no traceback, a
non-zero exit; and from an engine core that meets it while loading, the same line."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from real_model import requires_model
from tiny_files import bpe_fields, cut_short, tiny_gguf, tiny_hf_dir, tokenizer_gguf

from serval.errors import ModelFileError
from serval.model.model_files import GGUF_ARCHITECTURES, HF_ARCHITECTURES, check_model_files

REPO = Path(__file__).resolve().parents[2]
SERVAL = [sys.executable, "-m", "serval.cli"]

pytestmark = requires_model  # the GGUF files carry a cut of SmolLM2's tokenizer


def refusal(path: Path, **kwargs) -> str:
    with pytest.raises(ModelFileError) as info:
        check_model_files(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_architecture_lists_are_the_loaders():
    from serval.model.gguf_file import ARCHITECTURES
    from serval.model.hf_config import ARCHITECTURES as HF

    assert GGUF_ARCHITECTURES == ARCHITECTURES and HF_ARCHITECTURES == HF


def test_a_whole_gguf_and_a_whole_directory_pass(tmp_path):
    check_model_files(tiny_gguf(tmp_path / "tiny.gguf"))
    check_model_files(tiny_hf_dir(tmp_path / "tiny"))


def test_a_gguf_file_empty_cut_short_or_damaged_is_named_with_its_fault(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.touch()
    assert refusal(empty) == f"{empty}: the file is empty"
    cut = cut_short(tiny_gguf(tmp_path / "cut.gguf"), 100)
    size = cut.stat().st_size
    message = refusal(cut)
    assert message.startswith(f"{cut}: the file is cut short")
    assert f"tensor token_embd.weight ends at byte {size + 100:,}, the file has {size:,}" in message
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:5000])  # inside the vocabulary
    assert refusal(header_cut).startswith(f"{header_cut}: the GGUF header is cut short or damaged")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    assert refusal(other) == f"{other}: not a GGUF file (it begins with b'PK\\x03\\x04', not b'GGUF')"


def test_a_gguf_of_another_architecture_or_without_a_tokenizer_is_refused(tmp_path):
    mamba = tokenizer_gguf(tmp_path / "mamba.gguf", "mamba", bpe_fields())
    assert refusal(mamba).startswith(f"{mamba}: architecture 'mamba' is not supported (safetensors directories: ")
    bare = tokenizer_gguf(tmp_path / "bare.gguf", "qwen2", [])
    assert refusal(bare) == f"{bare}: no tokenizer: the GGUF header has no tokenizer.ggml.tokens"
    check_model_files(bare, tokenizer=False)  # a caller with its own tokenizer


def test_a_directory_is_refused_for_its_weights_its_architecture_or_its_missing_tokenizer(tmp_path):
    weights = tiny_hf_dir(tmp_path / "cut") / "model.safetensors"
    size = cut_short(weights, 10).stat().st_size
    assert refusal(weights.parent) == (f"{weights}: the file is cut short (a download or copy that stopped?): tensor "
                                       f"b ends at byte {size + 10:,}, the file has {size:,}")
    header = tiny_hf_dir(tmp_path / "header") / "model.safetensors"
    header.write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}" + bytes(64))
    assert refusal(header.parent) == f"{header}: not a safetensors file (its header is not JSON)"
    empty = tiny_hf_dir(tmp_path / "empty") / "model.safetensors"
    empty.write_bytes(b"")
    assert refusal(empty.parent) == f"{empty}: the file is empty"
    bert = tiny_hf_dir(tmp_path / "bert", "BertModel")
    assert refusal(bert).startswith(f"{bert / 'config.json'}: architecture 'BertModel' is not supported")
    shards = tiny_hf_dir(tmp_path / "shards")
    (shards / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    assert refusal(shards) == (f"{shards / 'model.safetensors.index.json'}: names 1 missing file(s): "
                               "model-00002-of-00002.safetensors")
    no_tokenizer = tiny_hf_dir(tmp_path / "no-tokenizer", tokenizer=False)
    assert refusal(no_tokenizer) == (f"{no_tokenizer}: no tokenizer: expected tokenizer.json, tokenizer.model, or "
                                     "vocab.json with merges.txt")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVAL, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line a failed command printed last, with no traceback before it."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("serval: error: "), proc.stderr
    return line.removeprefix("serval: error: ")


def test_generate_names_a_cut_gguf_file_and_an_empty_one_in_one_line(tmp_path):
    cut = cut_short(tiny_gguf(tmp_path / "cut.gguf"), 100)
    proc = _run("generate", "hi", "--model", str(cut))
    assert _error_line(proc).startswith(f"{cut}: the file is cut short")
    assert len(proc.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty.gguf"
    empty.touch()
    assert _error_line(_run("generate", "hi", "--model", str(empty))) == f"{empty}: the file is empty"


def test_serve_names_a_cut_safetensors_file_and_an_unknown_architecture_in_one_line(tmp_path):
    weights = tiny_hf_dir(tmp_path / "cut") / "model.safetensors"
    cut_short(weights, 10)
    assert _error_line(_run("serve", "--port", "0", "--model", str(weights.parent))).startswith(
        f"{weights}: the file is cut short")
    bert = tiny_hf_dir(tmp_path / "bert", "BertModel")
    assert _error_line(_run("serve", str(bert), "--port", "0")).startswith(
        f"{bert / 'config.json'}: architecture 'BertModel' is not supported")
    assert _error_line(_run("generate", "hi", "--model", str(weights.parent))).startswith(
        f"{weights}: the file is cut short")


def test_an_engine_core_that_meets_a_bad_model_file_sends_back_its_one_line(tmp_path, monkeypatch):
    """The front end's own check off (as if the file changed after it), the core process refuses the file in its
    check before loading, and the front end raises the same one line (ModelFileError), not a RuntimeError."""
    from serval.config import EngineConfig
    from serval.engine import frontend
    from serval.engine.core_client import CoreProcessClient
    from serval.tokenizer import Tokenizer

    mamba = tokenizer_gguf(tmp_path / "mamba.gguf", "mamba", bpe_fields(),
                           {"token_embd.weight": gguf.np.zeros((8, 8), gguf.np.float32)})
    tokenizer = Tokenizer.load(tiny_gguf(tmp_path / "tiny.gguf"))
    monkeypatch.setattr(frontend, "check_model_files", lambda path, tokenizer=True, weights=True: None)
    monkeypatch.setattr(frontend.Tokenizer, "load", lambda path: tokenizer)
    with pytest.raises(ModelFileError) as info:
        CoreProcessClient(EngineConfig(model=str(mamba), device="cpu"))
    assert str(info.value).startswith(f"{mamba}: architecture 'mamba' is not supported")


def test_a_model_without_tokenizer_files_fails_at_once_in_generate_and_serve(tmp_path):
    """Not a hang (generate) nor a server whose every prompt is zero ids (serve): one line naming the files
    expected."""
    directory = tiny_hf_dir(tmp_path / "no-tokenizer", "Qwen2ForCausalLM", tokenizer=False)
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    expected = (f"{directory}: no tokenizer: expected tokenizer.json, tokenizer.model, or vocab.json with "
                "merges.txt")
    assert _error_line(_run("generate", "hi", "--model", str(directory), timeout=60)) == expected
    assert _error_line(_run("serve", str(directory), "--port", "0", timeout=60)) == expected
