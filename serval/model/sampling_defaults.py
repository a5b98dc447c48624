"""A model's own sampling defaults: read from its generation_config.json or its GGUF ``general.sampling.*`` keys, or
a preset for an embedded model whose file has none (vLLM's ``--generation-config`` and
``--override-generation-config``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from serval.model.registry import sampling_preset
from serval.sampling_params import MODEL_DEFAULT_FIELDS, check_sampling_defaults

# llama.cpp's names (gguf-py's Keys.General.SAMPLING_*) for the fields Serval applies.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a directory holding a generation_config.json


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling fields a request that leaves them out gets, and where they came from (for the log and
    /v1/models). Fields not in ``values`` take SamplingParams' own defaults (OpenAI's: temperature 1.0, ...)."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str = "none"

    def describe(self) -> str:
        """One line: "temperature=0.2 top_p=0.9 (from ...)"."""
        fields = " ".join(f"{k}={v}" for k, v in self.values.items()) or "none (OpenAI's: temperature 1.0)"
        return f"{fields} (from {self.source})"


def read_generation_config(directory: str | Path) -> dict[str, float | int]:
    """The sampling fields of ``directory``/generation_config.json (a Hugging Face model's); {} without the file."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    values = {name: raw[name] for name in MODEL_DEFAULT_FIELDS if raw.get(name) is not None}
    return check_sampling_defaults(values, str(path))


def read_gguf_sampling(path: str | Path) -> dict[str, float | int]:
    """The ``general.sampling.*`` keys of a GGUF file, under SamplingParams' names; {} where it has none."""
    from serval.gguf_reader import GGUFContents  # numpy: imported here, after `serve` has started the core

    header = GGUFContents(path)
    values = {name: header.value(key) for key, name in GGUF_SAMPLING_KEYS.items() if key in header.fields}
    # Stored as float32: 0.2 reads back as 0.20000000298; 7 digits say what was written.
    values = {k: float(f"{v:.7g}") if isinstance(v, float) else v for k, v in values.items()}
    return check_sampling_defaults(values, str(path))


def resolve_sampling_defaults(model: str | None, model_path: str | Path, generation_config: str = "auto",
                              override: dict | None = None) -> SamplingDefaults:
    """The defaults in force for ``model`` (EngineConfig.model: an embedded name, or a path), found at
    ``model_path`` (a GGUF file or a Hugging Face directory).

    ``generation_config``: "auto", the model's (its file's, else an embedded model's preset, model/registry.py);
    "vllm", none (OpenAI's); or a directory whose generation_config.json to read. ``override`` goes on top."""
    model_path = Path(model_path)
    embedded = sampling_preset(model)
    if generation_config == "vllm":
        values, source = {}, "none: --generation-config vllm"
    elif generation_config == "auto":
        if model_path.is_dir():
            values, source = read_generation_config(model_path), str(model_path / GENERATION_CONFIG_FILE)
        else:
            values, source = read_gguf_sampling(model_path), f"{model_path.name}'s general.sampling keys"
        if not values and embedded is not None and embedded[1]:
            values, source = embedded[1], f"Serval's preset for {embedded[0]}"
        elif not values:
            source = "none: the model has no sampling defaults"
    else:
        directory = Path(generation_config)
        if not (directory / GENERATION_CONFIG_FILE).is_file():
            raise FileNotFoundError(f"--generation-config {generation_config}: no {GENERATION_CONFIG_FILE} there")
        values, source = read_generation_config(directory), str(directory / GENERATION_CONFIG_FILE)
    if override:
        values = {**values, **check_sampling_defaults(override, "--override-generation-config")}
        source += ", with --override-generation-config"
    return SamplingDefaults(values, source)
