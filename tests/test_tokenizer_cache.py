"""A GGUF file's tokenizer read back from Serval's cache (SERVAL_CACHE_DIR) tokenizes exactly as the one converted
from the file: for every family whose tokenizer transformers builds in its own class (Qwen2's, Gemma's), a cached
tokenizer must not be rebuilt by that class with other rules (issue 51: "a\\n\\nb" came back as [81, 1116, 82]
instead of the file's [81, 198, 198, 82])."""

from __future__ import annotations

import pytest
from real_model import requires_model
from tiny_files import bpe_fields, spm_fields, tokenizer_gguf

from serval import tokenizer as tokenizer_module
from serval.tokenizer import Tokenizer, _load_hf_tokenizer

TEXTS = ["a\n\nb", "Hello, world!\n\n\nThree new lines.  Two spaces,\tand a tab.", "  leading spaces", "12345 678",
         "ünïcödé ✓ 漢字 🙂", "<|im_start|>user\nhi<|im_end|>\n", "<start_of_turn>user\nhello<end_of_turn>", ""]

# Each family's GGUF as llama.cpp writes it: byte-level BPE for Llama 3, Qwen2, Qwen3 and Qwen3-MoE; SentencePiece
# for Gemma 2 and 3 (and Phi-3, whose normalizer transformers writes itself).
FAMILIES = {"llama": bpe_fields, "qwen2": bpe_fields, "qwen3": bpe_fields, "qwen3moe": bpe_fields,
            "gemma2": spm_fields, "gemma3": spm_fields, "phi3": spm_fields, "llama-spm": spm_fields}


@requires_model
@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_gguf_tokenizer_tokenizes_as_the_file_says(family, tmp_path, monkeypatch):
    monkeypatch.setenv("SERVAL_CACHE_DIR", str(tmp_path / "cache"))
    architecture = family.removesuffix("-spm")
    path = tokenizer_gguf(tmp_path / f"{family}.gguf", architecture, FAMILIES[family]())
    # What the file says: transformers' tokenizer converted from the header, never saved and read back.
    reference = _load_hf_tokenizer(path.parent, gguf_file=path.name)
    conversions = []
    convert = tokenizer_module._convert_in_a_child

    def counting(path, out):
        conversions.append(path.name)
        return convert(path, out)

    monkeypatch.setattr(tokenizer_module, "_convert_in_a_child", counting)
    first, cached = Tokenizer.load(path), Tokenizer.load(path)
    assert conversions == [path.name]  # the second load read the cache
    for tokenizer in (first, cached):
        for text in TEXTS:
            for special in (True, False):
                want = reference.backend_tokenizer.encode(text, add_special_tokens=special).ids
                assert tokenizer.encode(text, add_special_tokens=special) == want, (text, special)
                assert tokenizer.decode(want, skip_special_tokens=False) == reference.backend_tokenizer.decode(
                    want, skip_special_tokens=False)
        assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            len(reference), reference.bos_token_id, reference.eos_token_id)
        assert tokenizer.hf_tokenizer.added_tokens_decoder.keys() == reference.added_tokens_decoder.keys()
    assert cached.chat_template == first.chat_template and cached.eos_token_ids == first.eos_token_ids
    if FAMILIES[family] is bpe_fields:  # the file's byte-level rules: two new lines are two tokens here
        assert cached.encode("a\n\nb") == [81, 198, 198, 82]
