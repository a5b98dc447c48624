"""The int8 weight-only engine, with bfloat16 and float32 activations: still answers right, and greedy output still
does not depend on batching."""

from __future__ import annotations

import pytest
from real_model import requires_model

from serval import LLM, SamplingParams
from serval.layers.linear import Int8Linear

pytestmark = [pytest.mark.slow, requires_model]

PROMPTS = ["The capital city of Korea is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "A list of fruits: apple, banana,", "Photosynthesis is the process"]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def int8_llm(request):
    """int8 weights with bfloat16 (what `--quantization int8` gives by default) or float32 activations."""
    return LLM(dtype=request.param, quantization="int8", num_blocks=256, max_model_len=1024)


def test_int8_model_answers_the_question(int8_llm):
    assert any(isinstance(m, Int8Linear) for m in int8_llm.engine.model.modules())
    out = int8_llm.chat([{"role": "user", "content": "What is the capital city of Korea?"}],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Seoul" in out.text


def test_int8_greedy_is_the_same_alone_and_batched(int8_llm):
    params = SamplingParams(temperature=0, max_tokens=16)
    alone = [int8_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in int8_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert batched == alone
