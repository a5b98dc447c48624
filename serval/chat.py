"""Chat messages → prompt token ids under the context window, by the chosen policy."""

from __future__ import annotations

from dataclasses import dataclass

from serval.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from serval.tokenizer import Tokenizer


@dataclass
class ChatPrompt:
    token_ids: list[int]
    num_dropped_messages: int = 0  # oldest turns left out by the sliding-window policy


def build_chat_prompt(tokenizer: Tokenizer, messages: list[dict], max_prompt_tokens: int,
                      policy: str = "error", tools: list[dict] | None = None) -> ChatPrompt:
    """Renders ``messages`` with the model's chat template.

    ``policy="error"`` rejects a chat longer than ``max_prompt_tokens``; ``"sliding_window"`` keeps the system
    prompt and the most recent messages, dropping the oldest turns until it fits. A chat that does not fit is a
    RequestError naming ``messages`` (code context_length_exceeded)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools)
    if len(ids) <= max_prompt_tokens:
        return ChatPrompt(ids)
    if policy != "sliding_window":
        raise RequestError("messages", f"the chat is {len(ids)} tokens, more than the {max_prompt_tokens} the "
                           "context window leaves for the prompt (the sliding_window context policy drops old turns)",
                           CONTEXT_LENGTH_EXCEEDED)
    system = [m for m in messages[:1] if m.get("role") == "system"]
    history = messages[len(system):]
    # How many of the oldest turns to drop: at least one, never the last message, and a chat should open with
    # the user's turn (an assistant turn left at the front is dropped too). Fewer dropped never makes the prompt
    # shorter, so the least that fits is found by bisection: a dozen renders for thousands of turns, not one each.
    candidates = [dropped for dropped in range(1, len(history)) if history[dropped].get("role") != "assistant"]
    best: ChatPrompt | None = None
    low, high = 0, len(candidates)
    while low < high:
        middle = (low + high) // 2
        ids = tokenizer.apply_chat_template(system + history[candidates[middle]:], tools=tools)
        if len(ids) <= max_prompt_tokens:
            best, high = ChatPrompt(ids, candidates[middle]), middle
        else:
            low = middle + 1
    if best is None:
        raise RequestError("messages", f"the last message alone does not fit in the {max_prompt_tokens} prompt "
                           "tokens the context window leaves", CONTEXT_LENGTH_EXCEEDED)
    return best
