"""serval/gguf_reader.py reads what the gguf package's reader reads (every key's value and type, every tensor's
name, shape, type and bytes), on a file written with every value type and on the embedded model's file; and the
tokenizer a GGUF file converts to is cached by its header's bytes: read back, it encodes, decodes and templates as
the converted one."""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import quantize
from tiny_models import gguf_tokenizer_fields, tiny_family, write_gguf

from serval import tokenizer as tokenizer_module
from serval.gguf_reader import _GGML_TYPES, GGUFContents, ggml_type
from serval.model.registry import resolve_model_path
from serval.tokenizer import Tokenizer

MODEL_PATH = resolve_model_path(None)


def _assert_same_as_gguf_package(path) -> None:
    ours, theirs = GGUFContents(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [key for key in theirs.fields if not key.startswith("GGUF.")]
    for key, field in ours.fields.items():
        expected = theirs.fields[key]
        assert ours.value(key) == expected.contents(), key
        assert field.type == expected.types[0], key
        if field.type == gguf.GGUFValueType.ARRAY:
            assert ours.array_length(key) == len(expected.data), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert mine.tensor_type == int(reference.tensor_type), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_every_value_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path):
    path = tmp_path / "all_types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.2)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strings", ["a", "", "ünï", "<|im_end|>"])
    writer.add_array("t.no_items", [])
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", dense)
    writer.add_tensor("f16", dense.astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        writer.add_tensor(qtype.name, quantize(dense, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    _assert_same_as_gguf_package(path)
    header = GGUFContents(path)
    assert header.value("t.strings") == ["a", "", "ünï", "<|im_end|>"]
    assert header.value("t.missing", 7) == 7 and header.array_length("t.str") is None
    assert np.array_equal(header.tensors[0].data, dense)


def test_the_embedded_models_file_reads_as_the_gguf_package_reads_it():
    _assert_same_as_gguf_package(MODEL_PATH)


def test_a_converted_gguf_tokenizer_is_cached_and_reads_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVAL_CACHE_DIR", str(tmp_path))
    conversions = []
    convert = tokenizer_module._convert_in_a_child  # the conversion runs in a child process

    def counting(path, out):
        conversions.append(path.name)
        return convert(path, out)

    monkeypatch.setattr(tokenizer_module, "_convert_in_a_child", counting)
    converted = Tokenizer.load(MODEL_PATH)
    assert conversions == [MODEL_PATH.name]
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()  # no partial folder left behind

    cached = Tokenizer.load(MODEL_PATH)
    assert conversions == [MODEL_PATH.name]  # read back, not converted again
    texts = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "ünïcödé ✓ 漢字 🙂",
             "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159", ""]
    for text in texts:
        for special in (True, False):
            ids = converted.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, (text, special)
            assert cached.decode(ids) == converted.decode(ids)
            assert cached.decode(ids, skip_special_tokens=False) == converted.decode(ids, skip_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert cached.chat_template == converted.chat_template
    assert cached.chat_template_source == converted.chat_template_source
    assert cached.apply_chat_template(messages) == converted.apply_chat_template(messages)
    assert cached.eos_token_ids == converted.eos_token_ids and cached.eos_token_ids

    # Another file with the same header shares the entry; a header with another template converts into its own.
    fields = gguf_tokenizer_fields(MODEL_PATH)
    model = tiny_family("llama", vocab_size=49152, bos_token_id=1, eos_token_id=2)
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, model, "F32", tokenizer=fields)
    assert Tokenizer.load(tmp_path / "a.gguf").chat_template == converted.chat_template
    assert Tokenizer.load(tmp_path / "b.gguf").chat_template == converted.chat_template
    assert conversions == [MODEL_PATH.name, "a.gguf"]
    other = [f for f in fields if f[0] != "tokenizer.chat_template"]
    other.append(("tokenizer.chat_template", "{{ messages[0]['content'] }}", gguf.GGUFValueType.STRING, None))
    write_gguf(tmp_path / "c.gguf", model, "F32", tokenizer=other)
    assert Tokenizer.load(tmp_path / "c.gguf").render_chat(messages) == "Be brief."
    assert conversions == [MODEL_PATH.name, "a.gguf", "c.gguf"]
    assert len(list((tmp_path / "tokenizers").iterdir())) == 3


def test_the_ggml_types_serval_knows_are_the_gguf_packages():
    """Serval's own table of ggml types (so that a start need not import the gguf package) names and sizes each as
    the package does, and an id outside it is looked up there."""
    for type_id, (name, block, size) in _GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert (name, block, size) == (qtype.name, *gguf.GGML_QUANT_SIZES[qtype])
    iq4 = gguf.GGMLQuantizationType.IQ4_XS
    assert ggml_type(int(iq4)) == ("IQ4_XS", *gguf.GGML_QUANT_SIZES[iq4])
