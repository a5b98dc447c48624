"""`serval bench throughput` end to end in its default configuration: Serval and transformers on the embedded model,
the report written as JSON with the dtype and weight form the engine really resolved to."""

from __future__ import annotations

import json

import pytest
from real_model import requires_model

from serval.cli import main
from serval.config import EngineConfig


@pytest.mark.slow
@requires_model
def test_bench_throughput_defaults_run_both_engines_and_name_what_ran(tmp_path, capsys):
    report = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--num-prompts", "2", "--output-tokens", "4", "--output", str(report)]) == 0
    results = json.loads(report.read_text())
    serval, hf = results["serval"], results["transformers"]
    resolved = str(EngineConfig().torch_dtype).removeprefix("torch.")
    assert serval["dtype"] == hf["dtype"] == resolved  # "auto" is never reported: what ran is
    assert serval["quantization"] == "gguf"  # auto on the CPU: the file's blocks in place
    assert serval["generated_tokens"] == hf["generated_tokens"] == 2 * 4
    assert serval["tokens_per_s"] > 0 and results["serval_vs_transformers"] > 0
    assert "capability" in results["machine"]
    assert f"{resolved}+gguf" in capsys.readouterr().out
