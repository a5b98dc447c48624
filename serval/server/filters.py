"""Output filters: a hook that may end a stream with finish_reason "content_filter"."""

from __future__ import annotations

import re
from typing import Protocol


class OutputFilter(Protocol):
    def find(self, text: str, start: int = 0) -> int | None:
        """Index in ``text`` where disallowed content starts, or None when the text is fine. ``start``: where the
        search begins (a stream passes what an earlier search passed as safe, so no text is scanned twice)."""

    def safe_length(self, text: str) -> int:
        """How much of an unfinished text may be shown: what follows could still complete a blocked word."""


class NoFilter:
    def find(self, text: str, start: int = 0) -> int | None:
        return None

    def safe_length(self, text: str) -> int:
        return len(text)


class BlocklistFilter:
    """Blocks whole words or phrases, case-insensitively."""

    def __init__(self, words: list[str]) -> None:
        words = [w.strip() for w in words if w.strip()]
        if not words:
            raise ValueError("the blocklist filter needs at least one word")
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)
        self.max_words = max(len(w.split()) for w in words)

    def find(self, text: str, start: int = 0) -> int | None:
        match = self.pattern.search(text, start)  # \b at ``start`` still sees the character before it
        return None if match is None else match.start()

    def safe_length(self, text: str) -> int:
        end = len(text)
        partial = re.search(r"\w+$", text)  # a word still being written: "Seo" may become "Seoul"
        if partial:
            end = partial.start()
        for _ in range(self.max_words - 1):  # whole words that may open a blocked phrase
            word = re.search(r"\w+\W*$", text[:end])
            if word is None:
                break
            end = word.start()
        return end
