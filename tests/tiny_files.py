"""Small model files for the tests of loading and refusing models: GGUF headers with a tokenizer (cut from SmolLM2's,
or a SentencePiece one made up) and few or no tensors, and Hugging Face directories laid out as people give them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from real_model import MODEL_PATH
from tiny_models import gguf_tokenizer_fields

BPE_VOCAB = 3000  # SmolLM2's first tokens (its specials and bytes among them) and the merges among them: seconds


def bpe_fields() -> list[tuple]:
    """SmolLM2's byte-level BPE tokenizer fields, cut to its first BPE_VOCAB tokens and the merges among them."""
    fields = []
    kept: set[str] = set()
    for key, value, vtype, item in gguf_tokenizer_fields(MODEL_PATH):
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:BPE_VOCAB]
            if key == "tokenizer.ggml.tokens":
                kept = set(value)
        fields.append((key, value, vtype, item))
    for i, (key, value, vtype, item) in enumerate(fields):
        if key == "tokenizer.ggml.merges":
            merges = [m for m in value if (parts := m.split(" ")) and all(p in kept for p in parts)
                      and "".join(parts) in kept]
            fields[i] = (key, merges, vtype, item)
    return fields


def spm_fields() -> list[tuple]:
    """A small SentencePiece vocabulary as Gemma's files hold it: control tokens, the 256 byte tokens, a run of
    spaces spelled as spaces, and pieces whose merges transformers recovers from the vocabulary."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "a", "b", "e", "h", "l", "o", "w", "r", "d", "t", "n", "s", "u", "\n", "\n\n", "  ", "▁h", "▁he",
              "he", "ll", "▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world", "▁a", "▁b", "er", "us", "▁t",
              "▁th", "re", "ee", "1", "2", "3", ",", ".", "!", "▁1", "12", "123"]
    tokens = control + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3] * 3 + [2] + [3] * 2 + [6] * 256 + [1] * len(pieces)  # control, unknown, byte, normal
    scores = [0.0] * (len(control) + 256) + [-float(i) for i in range(len(pieces))]
    t = gguf.GGUFValueType
    return [("tokenizer.ggml.model", "llama", t.STRING, None), ("tokenizer.ggml.tokens", tokens, t.ARRAY, t.STRING),
            ("tokenizer.ggml.scores", scores, t.ARRAY, t.FLOAT32),
            ("tokenizer.ggml.token_type", types, t.ARRAY, t.INT32),
            ("tokenizer.ggml.bos_token_id", 2, t.UINT32, None), ("tokenizer.ggml.eos_token_id", 1, t.UINT32, None),
            ("tokenizer.ggml.unknown_token_id", 3, t.UINT32, None),
            ("tokenizer.ggml.padding_token_id", 0, t.UINT32, None),
            ("tokenizer.ggml.add_bos_token", True, t.BOOL, None)]


def tokenizer_gguf(path: Path, architecture: str, fields: list[tuple],
                   tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF file of ``architecture`` holding a header (a tokenizer and the shape keys) and ``tensors`` (none by
    default: all the tokenizer's conversion reads)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value, vtype, item in fields:
        writer.add_key_value(key, value, vtype, sub_type=item)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    """A small whole GGUF file: the cut BPE tokenizer and one float32 tensor of 4096 values."""
    return tokenizer_gguf(path, architecture, bpe_fields(),
                          {"token_embd.weight": np.arange(4096, dtype=np.float32).reshape(64, 64)})


def cut_short(path: Path, num_bytes: int) -> Path:
    """``path`` with its last ``num_bytes`` bytes cut off (a download that stopped)."""
    data = path.read_bytes()
    path.write_bytes(data[:-num_bytes])
    return path


def tiny_hf_dir(directory: Path, architecture: str = "LlamaForCausalLM", tokenizer: bool = True) -> Path:
    """A Hugging Face directory as the check reads it: config.json, one safetensors file of two tensors, and a
    tokenizer.json (its contents are not read by the check)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(f'{{"architectures": ["{architecture}"], "model_type": "llama"}}')
    save_file({"a": np.zeros((32, 32), np.float32), "b": np.ones(100, np.float32)},
              str(directory / "model.safetensors"))
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
    return directory


def hf_cache_layout(hf_home: Path, repo_id: str, model_dir: Path, revision: str = "0123abcd" * 5) -> Path:
    """Puts the files of ``model_dir`` into the Hugging Face cache under ``hf_home`` as huggingface_hub lays them
    out: blobs named by their sha256, a snapshot of symbolic links to them, refs/main naming the revision. Returns
    the snapshot folder."""
    import hashlib

    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model_dir.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot
