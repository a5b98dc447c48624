"""prompt_room, the one function that says how many prompt tokens fit beside max_tokens, agrees with the engine's own
check of a prompt against the context (InputProcessor): a prompt of exactly that many tokens is accepted, one more
is refused, for max_tokens left out (None), 0 (the prompt only) and a number."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serval.config import EngineConfig
from serval.engine.frontend import InputProcessor
from serval.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams, prompt_room

MAX_MODEL_LEN = 32


def _input_processor() -> InputProcessor:
    info = SimpleNamespace(max_model_len=MAX_MODEL_LEN, vocab_size=100)
    return InputProcessor(EngineConfig(), SimpleNamespace(eos_token_ids={0}), info)


@pytest.mark.parametrize("max_tokens", [None, 0, 1, 5, MAX_MODEL_LEN - 1])
def test_a_prompt_of_prompt_room_tokens_is_accepted_and_one_more_refused(max_tokens):
    processor = _input_processor()
    params = SamplingParams(max_tokens=max_tokens)
    room = prompt_room(MAX_MODEL_LEN, max_tokens)
    _, requests = processor.process("fits", [1] * room, params)
    # What the request may generate: max_tokens as given, or (None) all the context the prompt leaves.
    assert requests[0].max_tokens == (MAX_MODEL_LEN - room if max_tokens is None else max_tokens)
    with pytest.raises(ValueError, match="context"):
        processor.process("too-long", [1] * (room + 1), params)


def test_prompt_room_values():
    assert prompt_room(MAX_MODEL_LEN, None) == MAX_MODEL_LEN - 1  # up to the context: room for one token at least
    assert prompt_room(MAX_MODEL_LEN, 0) == MAX_MODEL_LEN  # scoring a prompt: it may fill the context
    assert prompt_room(MAX_MODEL_LEN, 8) == MAX_MODEL_LEN - 8
    assert prompt_room(MAX_MODEL_LEN, MAX_MODEL_LEN) == 0  # no room: the caller says so
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS == 16  # vLLM's and OpenAI's completions default
