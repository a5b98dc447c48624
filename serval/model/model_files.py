"""A model's files checked before anything loads them, so that a bad model fails at once with one line naming the
file and what is wrong with it (ModelFileError), not with a traceback from deep inside a reader: an empty file, a
GGUF header cut short or damaged, tensor data past a file's end (an interrupted download or copy), a safetensors
header that does not parse, an architecture Serval does not run, a directory without tokenizer files.

It reads headers only (milliseconds) and imports no torch: the server's process runs it before its engine core
starts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from serval.errors import ModelFileError
from serval.tokenizer import EXPECTED_TOKENIZER_FILES, has_tokenizer_files

# general.architecture values that load (model/gguf_file.py's ARCHITECTURES, which imports torch; a test keeps the
# two equal).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
# config.json's ``architectures`` (or its model_type, a family's name) that load (model/hf_config.py's ARCHITECTURES).
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                    "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
_SAFETENSORS_HEADER_LIMIT = 100 << 20  # as the safetensors library's own limit


def check_model_files(path: str | Path, tokenizer: bool = True, weights: bool = True) -> None:
    """Raises ModelFileError unless ``path`` (a .gguf file or a Hugging Face directory, as resolve_model_path gives)
    looks servable: readable, whole, of a supported architecture, with a tokenizer (unless ``tokenizer`` is False:
    the caller brings its own) and a directory's weights (unless ``weights`` is False: --load-format dummy)."""
    path = Path(path)
    if path.is_dir():
        _check_directory(path, tokenizer, weights)
    else:
        _check_gguf(path, tokenizer)


def unsupported_architecture(where: Path, name: object) -> ModelFileError:
    return ModelFileError(f"{where}: architecture {name!r} is not supported (safetensors directories: "
                          f"{', '.join(HF_ARCHITECTURES)}; GGUF files: {', '.join(GGUF_ARCHITECTURES)})")


def _check_gguf(path: Path, tokenizer: bool) -> None:
    from serval.gguf_reader import GGUFContents  # numpy: imported here, after `serve` has started the core

    try:
        header = GGUFContents(path)  # empty, another format, a damaged header, tensors past the end
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    architecture = header.value("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise unsupported_architecture(path, architecture)
    if tokenizer and not header.array_length("tokenizer.ggml.tokens"):
        raise ModelFileError(f"{path}: no tokenizer: the GGUF header has no tokenizer.ggml.tokens")


def _check_directory(path: Path, tokenizer: bool, weights: bool) -> None:
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no config.json (a Hugging Face model directory has one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{config_file}: not a JSON object")
    architectures = config.get("architectures") or [config.get("model_type", "")]
    name = architectures[0] if isinstance(architectures, list) and architectures else architectures
    if not isinstance(name, str) or (name not in HF_ARCHITECTURES and name not in HF_ARCHITECTURES.values()):
        raise unsupported_architecture(config_file, name)
    if tokenizer and not has_tokenizer_files(path):
        raise ModelFileError(f"{path}: no tokenizer: expected {EXPECTED_TOKENIZER_FILES}")
    if not weights:
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: no .safetensors files (--load-format dummy runs its config with random "
                             "weights)")
    _check_index(path)
    for file in files:
        _check_safetensors(file)


def _check_index(path: Path) -> None:
    """Every file model.safetensors.index.json names is there (a download that fetched some shards only)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelFileError(f"{index}: not valid JSON ({exc})") from None
    missing = sorted({f for f in weight_map.values() if isinstance(f, str) and not (path / f).is_file()})
    if missing:
        raise ModelFileError(f"{index}: names {len(missing)} missing file(s): {', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}")


def _check_safetensors(file: Path) -> None:
    """The header (8 bytes of length, then JSON) parses and every tensor's data lies inside the file."""
    cut_short = f"{file}: the file is cut short (a download or copy that stopped?)"
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            if size == 0:
                raise ModelFileError(f"{file}: the file is empty")
            if size < 8:
                raise ModelFileError(f"{cut_short}: {size} bytes, not even a header's length")
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > _SAFETENSORS_HEADER_LIMIT:
                raise ModelFileError(f"{file}: not a safetensors file (its header would be {header_size:,} bytes)")
            if 8 + header_size > size:
                raise ModelFileError(f"{cut_short}: its header is {header_size:,} bytes, the file has {size:,}")
            raw = f.read(header_size)
    except OSError as exc:
        raise ModelFileError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFileError(f"{file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: not a safetensors file (its header is not a JSON object)")
    data_start = 8 + header_size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ModelFileError(f"{file}: tensor {name} has no valid data_offsets in the header (a damaged file?)")
        if data_start + offsets[1] > size:
            raise ModelFileError(f"{cut_short}: tensor {name} ends at byte {data_start + offsets[1]:,}, the file "
                                 f"has {size:,}")
