"""The context policy: a chat that does not fit is rejected, or its oldest turns are dropped."""

from __future__ import annotations

import random

import pytest
from real_model import MODEL_PATH, requires_model

from serval.chat import build_chat_prompt
from serval.errors import RequestError
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
    with pytest.raises(RequestError, match=f"{full} tokens"):
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
    with pytest.raises(RequestError, match="last message"):
        build_chat_prompt(tokenizer, _history(3), 10, policy="sliding_window")


class _CountingTokenizer:
    """A token per character plus three per message; counts the renders."""

    def __init__(self) -> None:
        self.renders = 0

    def apply_chat_template(self, messages, tools=None):
        self.renders += 1
        return [0] * sum(len(m["content"]) + 3 for m in messages)


def _drop_one_at_a_time(tokenizer, messages, limit) -> int | None:
    """The sliding window's definition: the fewest oldest turns dropped (never leaving an assistant turn first)."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    history = messages[len(system):]
    if len(tokenizer.apply_chat_template(messages)) <= limit:
        return 0
    for dropped in range(1, len(history)):
        if history[dropped]["role"] != "assistant" and len(
                tokenizer.apply_chat_template(system + history[dropped:])) <= limit:
            return dropped
    return None


def test_sliding_window_finds_the_same_turns_as_dropping_one_at_a_time_in_a_few_renders():
    rng = random.Random(0)
    for _ in range(2000):
        messages = [{"role": "system", "content": "s" * rng.randint(0, 5)}] if rng.random() < 0.5 else []
        messages += [{"role": rng.choice(["user", "assistant"]), "content": "x" * rng.randint(0, 9)}
                     for _ in range(rng.randint(1, 12))]
        limit = rng.randint(1, 80)
        expected = _drop_one_at_a_time(_CountingTokenizer(), messages, limit)
        try:
            dropped = build_chat_prompt(_CountingTokenizer(), messages, limit, "sliding_window").num_dropped_messages
        except RequestError:
            dropped = None
        assert dropped == expected, (messages, limit)
    # 2,501 short messages (the case, 156 s when every dropped turn was a render): a dozen renders.
    tokenizer = _CountingTokenizer()
    messages = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}."} for i in range(2_500)]
    prompt = build_chat_prompt(tokenizer, messages, 500, "sliding_window")
    assert len(prompt.token_ids) <= 500 and 2_400 < prompt.num_dropped_messages < 2_500
    assert tokenizer.renders <= 1 + 12
