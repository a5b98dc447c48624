"""A model without a usable tokenizer is refused at load, naming the files expected: a directory without tokenizer
files (transformers would build an empty tokenizer from its tokenizer_config.json alone, and every prompt would be
zero ids), or one whose tokenizer has an empty vocabulary."""

from __future__ import annotations

import json

import pytest

from serval.errors import ModelFileError
from serval.tokenizer import Tokenizer

EXPECTED = "expected tokenizer.json, tokenizer.model, or vocab.json with merges.txt"


def test_a_directory_without_tokenizer_files_is_refused_naming_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(ModelFileError) as info:
        Tokenizer.load(tmp_path)
    assert str(info.value) == f"{tmp_path}: no tokenizer: {EXPECTED}"


def test_a_tokenizer_of_an_empty_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE

    RustTokenizer(BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelFileError) as info:
        Tokenizer.load(tmp_path)
    assert str(info.value) == f"{tmp_path}: no usable tokenizer: its vocabulary is empty ({EXPECTED})"


def test_a_damaged_tokenizer_file_is_one_line_naming_the_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFileError) as info:
        Tokenizer.load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: its tokenizer cannot be built from its files (")
    assert "\n" not in str(info.value)
