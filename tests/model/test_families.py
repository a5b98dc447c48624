"""Llama (3's RoPE scaling), Qwen2, Qwen3, Mistral, Phi-3 (fused checkpoint tensors, LongRoPE), Gemma 2 (soft-capped
attention and logits), Mixtral and Qwen3-MoE (mixtures of experts; more in test_moe.py) from Hugging Face safetensors
directories: tiny random models built with transformers' own classes give transformers' logits in float32 and its
greedy text through the engine, and their greedy output does not change with batching or chunking in the default
dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_model import MODEL_PATH, requires_model
from test_llama import FP32_REL, assert_logits_close, random_ids
from tiny_models import FAMILY_OVERRIDES, full_logits, hf_logits, save_family_dir, tiny_family
from transformers import DynamicCache

from serval.config import CacheConfig, EngineConfig, SchedulerConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.layers import cpu_kernels
from serval.layers.attention.torch_reference import TorchReferenceBackend
from serval.layers.rotary import RotaryEmbedding
from serval.model.hf_config import ARCHITECTURES
from serval.model.loader import load_model
from serval.sampling_params import SamplingParams
from serval.tokenizer import Tokenizer

pytestmark = requires_model  # the tokenizer (and its chat template) is the embedded SmolLM2's

FAMILIES = list(FAMILY_OVERRIDES)
# Longer than the windows (8 keys) and than Llama 3's original context (64 positions).
LONG = random_ids(80, seed=5)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return Tokenizer.load(MODEL_PATH).hf_tokenizer


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, hf_tokenizer, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    """(family, the transformers model, its directory)."""
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, save_family_dir(directory, request.param, hf_tokenizer), directory


def test_every_family_is_read_from_its_architecture_name(family):
    name, hf, directory = family
    assert ARCHITECTURES[type(hf).__name__] == name
    model = load_model(directory, torch.float32)
    assert model.config.architecture == name
    attention = model.layers[0].self_attn
    assert (getattr(attention, "qkv_proj_bias", None) is not None) == (name == "qwen2")
    assert (attention.q_norm is not None) == (name in ("qwen3", "qwen3_moe"))
    assert getattr(attention, "softcap", None) == (2.0 if name == "gemma2" else None)
    windows = {"qwen2": [None, 8, 8], "mistral": [8, 8, 8], "phi3": [8, 8, 8], "gemma2": [8, None, 8],
               "mixtral": [8, 8, 8]}
    assert [layer.self_attn.window for layer in model.layers] == windows.get(name, [None, None, None])


def test_fp32_logits_match_transformers(family, monkeypatch):
    """Where the C++ kernels are built, every layer's attention runs on them, Gemma 2's soft-capped ones included
    (the cap passed to the kernel, the PyTorch reference never called)."""
    name, hf, directory = family
    ours = load_model(directory, torch.float32)
    want = hf_logits(hf, LONG)
    kernels, caps = cpu_kernels.load(), []
    if kernels is not None:
        kernel_attention = kernels.paged_attention
        monkeypatch.setattr(kernels, "paged_attention", lambda *args: caps.append(args[-1]) or kernel_attention(*args))
        monkeypatch.setattr(TorchReferenceBackend, "attend", None)  # a call would fail
    got = full_logits(ours, LONG)
    if kernels is not None:
        assert caps == [2.0 if name == "gemma2" else 0.0] * len(ours.layers)
        monkeypatch.undo()
    print(f"{name}: max |ours - transformers| = {(got - want).abs().max():.3g}, logit scale "
          f"{want.abs().max():.3g}")
    assert_logits_close(got, want, FP32_REL)
    windows = [layer.self_attn.window for layer in ours.layers]
    if any(windows):  # the prompt is long enough that the window decides the logits
        for layer in ours.layers:
            layer.self_attn.window = None
        unwindowed = full_logits(ours, LONG)
        assert (unwindowed - want).abs().max() > 100 * FP32_REL * want.abs().max()
        for layer, window in zip(ours.layers, windows):
            layer.self_attn.window = window
    if name == "gemma2":  # each cap decides the logits too
        for layer in ours.layers:
            layer.self_attn.softcap = None
        assert (full_logits(ours, LONG) - want).abs().max() > 100 * FP32_REL * want.abs().max()
        ours = load_model(directory, torch.float32)
        ours.config.final_logit_softcapping = None
        assert (full_logits(ours, LONG) - want).abs().max() > 100 * FP32_REL * want.abs().max()


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a terse assistant who answers in one line."},
          {"role": "user", "content": "List the first five prime numbers, then say which of them is even."}]]


def _llm(directory: Path, model: torch.nn.Module, tokenizer: Tokenizer, dtype: str = "float32",
         **scheduler) -> LLM:
    config = EngineConfig(model=str(directory), dtype=dtype, scheduler=SchedulerConfig(**scheduler),
                          activation_quantization="none",  # transformers' float activations, as the dtype is theirs
                          cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    return LLM.from_engine(LLMEngine(config, model=model, tokenizer=tokenizer))


def test_greedy_text_equals_transformers_generate(family):
    """Chats through the directory's chat template; the engine stops at the directory's end-of-sequence ids."""
    name, hf, directory = family
    tokenizer = Tokenizer.load(directory)
    assert "<|im_start|>" in tokenizer.chat_template
    llm = _llm(directory, load_model(directory, torch.float32), tokenizer)
    assert_chats_equal_generate(llm, hf, tokenizer)


def assert_chats_equal_generate(llm, hf: torch.nn.Module, tokenizer: Tokenizer, max_tokens: int = 16) -> None:
    """``llm``'s greedy answers to CHATS are transformers' ``generate`` on the same prompt ids, token for token."""
    outputs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    for chat, output in zip(CHATS, outputs):
        ids = torch.tensor([hf_tokenizer_ids(tokenizer, chat)])
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=sorted(tokenizer.eos_token_ids),
                                 pad_token_id=tokenizer.eos_token_id)
        theirs = theirs[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == theirs
        assert output.outputs[0].text == tokenizer.decode(theirs)


def hf_tokenizer_ids(tokenizer: Tokenizer, chat: list[dict]) -> list[int]:
    """The chat's prompt ids as transformers' own tokenizer renders and encodes them."""
    hf = tokenizer.hf_tokenizer
    text = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return hf(text, add_special_tokens=False)["input_ids"]


# Prompts of 3 to 50 tokens (most longer than the windows), as token ids.
PROMPTS = [random_ids(n, seed=10 + n, vocab=49152) for n in (3, 9, 20, 33, 50)]


def test_default_dtype_greedy_is_batch_invariant_and_chunked(family):
    name, _, directory = family
    dtype = EngineConfig().torch_dtype  # what `serve` runs without --dtype on this CPU
    model, tokenizer = load_model(directory, dtype), Tokenizer.load(directory)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    alone = tokens(_llm(directory, model, tokenizer, "auto", max_num_seqs=1), PROMPTS)
    assert tokens(_llm(directory, model, tokenizer, "auto"), PROMPTS) == alone
    chunked = _llm(directory, model, tokenizer, "auto", max_num_batched_tokens=7)
    assert tokens(chunked, PROMPTS) == alone
    assert chunked.engine.stats.num_steps > len(PROMPTS) + greedy.max_tokens  # the long prompts were cut


def test_phi3_longrope_gives_transformers_logits_inside_and_past_the_original_context(hf_tokenizer, tmp_path):
    """Phi-3's LongRoPE (original context 64 of 256 positions). Inside it: a 60-token prompt's logits are
    transformers' (short factors, and the attention factor on cos and sin), and greedy text is its generate's. Past
    it, each position rotates by its own factors (the long ones from 64 on): the logits of positions 56-79 are those
    of transformers' forward fed one token at a time over its cache, which switches to the long factors there too.
    (transformers' generate instead drops its cache at the crossing and recomputes the whole sequence with the long
    factors; this engine keeps the cache.)"""
    gen = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
            "long_factor": (4 + 12 * torch.rand(8, generator=gen)).tolist()}
    hf = tiny_family("phi3", num_hidden_layers=2, vocab_size=len(hf_tokenizer), rope_parameters=rope,
                     original_max_position_embeddings=64, max_position_embeddings=256)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf_tokenizer.save_pretrained(tmp_path)
    ours = load_model(tmp_path, torch.float32)
    assert ours.config.rope_scaling["rope_type"] == "longrope"
    prompt = random_ids(80, seed=7, vocab=49152)
    assert_logits_close(full_logits(ours, prompt[:60]), hf_logits(hf, prompt[:60]), FP32_REL)

    llm = _llm(tmp_path, ours, Tokenizer.load(tmp_path))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = torch.tensor([prompt[:40]])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, pad_token_id=0)[0, 40:].tolist()
    assert llm.generate([prompt[:40]], greedy, use_tqdm=False)[0].outputs[0].token_ids == theirs

    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(input_ids=torch.tensor([prompt[:56]]), cache=cache, use_cache=True)
        stepped = torch.cat([hf(input_ids=torch.tensor([[prompt[p]]]), position_ids=torch.tensor([[p]]), cache=cache,
                                use_cache=True).logits[0] for p in range(56, 80)])
    assert_logits_close(full_logits(ours, prompt)[56:], stepped, FP32_REL)
    # The long factors decide those logits: with the short ones past position 64 too, they are far off.
    head_dim, max_position, theta, scaling = ours.rotary.args
    table = RotaryEmbedding(head_dim, max_position, theta, {**scaling, "long_factor": scaling["short_factor"]})
    ours.rotary.cos, ours.rotary.sin = table.cos, table.sin
    assert (full_logits(ours, prompt)[56:] - stepped).abs().max() > 100 * FP32_REL * stepped.abs().max()
