"""csrc/decoder_layers.cpp's LlamaLayer and LlamaLayers: a Llama decoder layer's kernel calls made in one call from
Python (model/llama.py, ``LlamaDecoderLayer.cpu_layer``), and all the layers in one (``LlamaForCausalLM.cpu_layers``),
give the Python path's bits: the same logprobs for every prompt token and every generated token, in the
configuration users get and in each kernel setting."""

from __future__ import annotations

import pytest

from serval.config import EngineConfig
from serval.engine.engine import LLMEngine
from serval.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea, the wind and the old lighthouse keeper who watched them both for years:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,",
]
# Every prompt token and every generated token scored, top 5 of each.
SCORED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=5)

SETTINGS = {
    "defaults": {"dtype": "bfloat16"},  # what users get: bfloat16, ngram speculation, chunked prefill
    "chunks of 7": {"dtype": "bfloat16", "max_num_batched_tokens": 7, "speculative_model": None},
    "fma": {"dtype": "bfloat16", "block_dot_products": "fma"},
    "bf16": {"dtype": "bfloat16", "block_dot_products": "bf16"},  # the vectors, where "auto" takes AMX tiles
    "int8 cache": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
    "int8 activations": {"dtype": "bfloat16", "activation_quantization": "int8"},
    "float32": {"dtype": "float32"},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_one_call_layer_gives_the_python_layers_bits(make_llm, setting):
    runs = {}
    llm = make_llm(enable_prefix_caching=False, **SETTINGS[setting])
    model = llm.engine.model
    layers = model.layers
    try:
        for path, cpu_layer in (("one call", None), ("python", False)):  # None: built again on the first step
            for layer in layers:
                layer.cpu_layer = cpu_layer
            model.cpu_layers = None
            outputs = llm.generate(PROMPTS, SCORED, use_tqdm=False)
            assert {type(layer.cpu_layer).__name__ for layer in layers} == (
                {"LlamaLayer"} if path == "one call" else {"bool"})
            # The layers in one call: built (by the step that then ran it) over the layers' forms, or never.
            forms = tuple(layer.cpu_layer for layer in layers)
            assert (model.cpu_layers is not None and model.cpu_layers[0] == forms) == (path == "one call")
            runs[path] = [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    finally:
        for layer in layers:
            layer.cpu_layer = None
    assert all(len(logprobs) == 12 for _, _, logprobs in runs["python"])
    assert runs["one call"] == runs["python"]


def test_enforce_eager_keeps_every_layer_on_the_python_path(smollm):
    """--enforce-eager runs each kernel from Python (EngineConfig.enforce_eager); an engine without it on the same
    model builds the one-call layers again."""
    model, tokenizer = smollm("bfloat16")
    kinds = {}
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(dtype="bfloat16", enforce_eager=eager), model=model, tokenizer=tokenizer)
        engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        kinds[eager] = {type(layer.cpu_layer).__name__ for layer in model.layers}
    assert kinds == {True: {"bool"}, False: {"LlamaLayer"}}


def test_the_layers_in_one_call_follow_the_layers_forms(smollm):
    """LlamaLayers is built over the layers' one-call forms, and built again once a layer has a new form (a caller
    that changes a layer's settings sets its ``cpu_layer`` to None); meanwhile the layers run one by one."""
    model, tokenizer = smollm("bfloat16")
    engine = LLMEngine(EngineConfig(dtype="bfloat16"), model=model, tokenizer=tokenizer)
    engine.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()  # the prompt: each layer builds its form
    engine.step()  # a decode: the layers in one call
    first = model.cpu_layers
    assert first is not None and first[0] == tuple(layer.cpu_layer for layer in model.layers)
    model.layers[3].cpu_layer = None
    engine.step()  # layer 3 builds its form again, the layers one by one
    assert model.cpu_layers is first and model.layers[3].cpu_layer is not first[0][3]
    engine.step()
    assert model.cpu_layers is not first and model.cpu_layers[0] == tuple(layer.cpu_layer for layer in model.layers)
    while engine.has_unfinished_requests():
        engine.step()
