"""Serval: an LLM serving engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from serval.platform_info import set_wait_policy

if TYPE_CHECKING:
    from serval.engine.engine import LLMEngine
    from serval.engine.llm import LLM
    from serval.outputs import CompletionOutput, RequestOutput
    from serval.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# Before anything imports torch: its OpenMP threads read their wait policy once, when they load (platform_info.py).
set_wait_policy()

# Loaded on first use, so that `import serval.cli` does not import torch: `serve` checks its port before that second.
_HOMES = {"LLM": "serval.engine.llm", "LLMEngine": "serval.engine.engine", "SamplingParams": "serval.sampling_params",
          "RequestOutput": "serval.outputs", "CompletionOutput": "serval.outputs"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'serval' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
