"""`serval bench quality`: perplexity through the engine's prompt logprobs equals transformers' on the same weights and
windows (float32), and each form is compared with that reference."""

from __future__ import annotations

import json
import math

import pytest
import torch
from real_model import MODEL_PATH, requires_model

from serval.benchmark.quality import reference_text, windows
from serval.cli import main


def test_windows_cover_the_text_and_drop_what_scores_nothing():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token window predicts nothing


@pytest.mark.slow
@requires_model
def test_perplexity_matches_transformers_and_forms_compare_to_float32(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = tmp_path / "quality.json"
    assert main(["bench", "quality", "--forms", "float32:none,bfloat16:gguf,bfloat16:gguf:int8", "--num-tokens", "96",
                 "--window", "48", "--num-prompts", "2", "--output-tokens", "8", "--output", str(report)]) == 0
    results = json.loads(report.read_text())
    reference, blocks = results["forms"]["float32:none"], results["forms"]["bfloat16:gguf"]
    assert reference["tokens_scored"] == blocks["tokens_scored"] == 2 * 47
    assert reference["identical"] == 1.0 and reference["perplexity_vs_reference"] == 1.0
    assert blocks["quantization"] == "gguf" and 0.0 <= blocks["mean_prefix_share"] <= 1.0
    assert 0.9 < blocks["perplexity_vs_reference"] < 1.1  # the same file's weights, in bfloat16
    int8 = results["forms"]["bfloat16:gguf:int8"]  # a third field: the activation quantization
    assert (blocks["activation_quantization"], int8["activation_quantization"]) == ("none", "int8")
    assert int8["quantization"] == "gguf" and 0.9 < int8["perplexity_vs_reference"] < 1.1

    # The same windows through transformers in float32: the same perplexity.
    tokenizer = AutoTokenizer.from_pretrained(MODEL_PATH.parent, gguf_file=MODEL_PATH.name)
    model = AutoModelForCausalLM.from_pretrained(MODEL_PATH.parent, gguf_file=MODEL_PATH.name,
                                                 dtype=torch.float32).eval()
    ids = tokenizer(reference_text())["input_ids"][:96]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for window in windows(ids, 48):
            logits = model(torch.tensor([window])).logits[0, :-1].double()
            nll -= torch.log_softmax(logits, -1).gather(1, torch.tensor(window[1:])[:, None]).sum().item()
            count += len(window) - 1
    assert math.isclose(reference["perplexity"], math.exp(nll / count), rel_tol=1e-3)
