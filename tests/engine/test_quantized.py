"""Quantized weights — weight-only int8, and the GGUF file's own Q4_1/Q8_0 blocks read in place — with bfloat16
and float32 activations: still answers right, and greedy output still does not depend on batching."""

from __future__ import annotations

import pytest
from real_model import requires_model

from serval import LLM, SamplingParams
from serval.layers.linear import BlockQuantLinear, Int8Linear

pytestmark = [pytest.mark.slow, requires_model]

PROMPTS = ["The capital city of Korea is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "A list of fruits: apple, banana,", "Photosynthesis is the process"]


LAYERS = {"int8": Int8Linear, "gguf": BlockQuantLinear}


@pytest.fixture(scope="module", params=[(q, d, "none") for q in LAYERS for d in ("bfloat16", "float32")]
                + [("gguf", "bfloat16", "int8")], ids=lambda p: "-".join(p))
def quantized_llm(request):
    """int8 or GGUF-block weights with bfloat16 (the default where the CPU has it) or float32 activations; and the
    GGUF blocks with int8 activations (EngineConfig.activation_quantization)."""
    quantization, dtype, activations = request.param
    llm = LLM(dtype=dtype, quantization=quantization, num_blocks=256, max_model_len=1024,
              activation_quantization=activations)
    assert any(isinstance(m, LAYERS[quantization]) for m in llm.engine.model.modules())
    return llm


def test_quantized_model_answers_the_question(quantized_llm):
    out = quantized_llm.chat([{"role": "user", "content": "What is the capital city of Korea?"}],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Seoul" in out.text


def test_quantized_greedy_is_the_same_alone_and_batched(quantized_llm):
    params = SamplingParams(temperature=0, max_tokens=16)
    alone = [quantized_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in quantized_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert batched == alone
