"""Output filters: a hook that may end a stream with finish_reason "content_filter"."""

from __future__ import annotations

import re
from typing import Protocol


class OutputFilter(Protocol):
    def find(self, text: str) -> int | None:
        """Index in ``text`` where disallowed content starts, or None when the text is fine."""


class NoFilter:
    def find(self, text: str) -> int | None:
        return None


class BlocklistFilter:
    """Blocks whole words or phrases, case-insensitively."""

    def __init__(self, words: list[str]) -> None:
        words = [w.strip() for w in words if w.strip()]
        if not words:
            raise ValueError("the blocklist filter needs at least one word")
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)

    def find(self, text: str) -> int | None:
        match = self.pattern.search(text)
        return None if match is None else match.start()
