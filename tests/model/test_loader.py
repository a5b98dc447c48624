"""load_model's annotation says what it returns: every architecture it builds, and a pipeline stage's wrapper."""

from __future__ import annotations

import typing

from serval.model import loader
from serval.model.parallel import PipelineStage


def test_load_model_is_annotated_with_every_type_it_returns():
    returned = set(typing.get_args(typing.get_type_hints(loader.load_model)["return"]))
    assert set(loader._MODEL_CLASSES.values()) | {PipelineStage} == returned
