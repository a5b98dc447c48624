"""The context policy: a chat that does not fit is rejected, or its oldest turns are dropped."""

from __future__ import annotations

import pytest
from real_model import MODEL_PATH, requires_model

from serval.chat import ContextLengthError, build_chat_prompt
from serval.tokenizer import Tokenizer

pytestmark = [requires_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(MODEL_PATH)


def _history(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question number {i}: tell me about the number {i}."})
        messages.append({"role": "assistant", "content": f"The number {i} is a fine number, one of many."})
    messages.append({"role": "user", "content": "And what is the capital city of Korea?"})
    return messages


def test_a_chat_that_fits_is_kept_whole(tokenizer):
    messages = _history(2)
    prompt = build_chat_prompt(tokenizer, messages, 10_000)
    assert prompt.num_dropped_messages == 0
    assert prompt.token_ids == tokenizer.apply_chat_template(messages)


def test_too_long_a_chat_is_an_error_by_default(tokenizer):
    messages = _history(10)
    full = len(tokenizer.apply_chat_template(messages))
    with pytest.raises(ContextLengthError, match=f"{full} tokens"):
        build_chat_prompt(tokenizer, messages, full - 1)


def test_sliding_window_keeps_system_prompt_and_latest_turns(tokenizer):
    messages = _history(10)
    full = len(tokenizer.apply_chat_template(messages))
    prompt = build_chat_prompt(tokenizer, messages, full // 2, policy="sliding_window")
    assert len(prompt.token_ids) <= full // 2
    assert prompt.num_dropped_messages > 0 and prompt.num_dropped_messages % 2 == 0  # whole turns
    text = tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    assert "You are terse." in text  # the system prompt stays
    assert "capital city of Korea" in text  # the latest question stays
    assert "Question number 0:" not in text and "Question number 9:" in text  # oldest turns went first
    kept = [messages[0]] + messages[1 + prompt.num_dropped_messages:]
    assert prompt.token_ids == tokenizer.apply_chat_template(kept)


def test_sliding_window_fails_when_the_last_message_alone_does_not_fit(tokenizer):
    with pytest.raises(ContextLengthError, match="last message"):
        build_chat_prompt(tokenizer, _history(3), 10, policy="sliding_window")
