"""Serval: an LLM serving engine."""

from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.outputs import CompletionOutput, RequestOutput
from serval.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
