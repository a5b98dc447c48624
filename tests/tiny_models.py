"""Tiny random Llamas (and Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Mixtral, Qwen3-MoE) built in the test (Hugging Face
reference, safetensors and GGUF forms), and helpers that drive a model over a paged KV cache through the engine's own
ModelRunner, without a scheduler."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers import LlamaForCausalLM as HFLlama

from serval.engine.request import Request
from serval.engine.runner import ModelRunner, StepInputs
from serval.engine.scheduler import SchedulerOutput
from serval.gguf_reader import GGUFContents
from serval.layers.embedding import embedding_dtype
from serval.sampling_params import SamplingParams

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# K-quants pack 256 weights per super-block, so every row (hidden or intermediate wide) must be a multiple of 256.
TINY_K = {**TINY, "hidden_size": 256, "intermediate_size": 512}


def tiny_llama(seed: int = 0, **overrides) -> HFLlama:
    """A random fp32 Hugging Face Llama, with weights at a scale that makes logits O(1) (HF's own init, std 0.02,
    gives near-zero logits that would hide errors) and norm weights away from 1 (so swapped norms show)."""
    torch.manual_seed(seed)
    return _randomized(HFLlama(LlamaConfig(**{**TINY, **overrides})), seed)


# The Hugging Face classes of each family model/hf_config.py reads: (config class, model class).
HF_FAMILIES = {"llama": (LlamaConfig, HFLlama), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "phi3": (Phi3Config, Phi3ForCausalLM), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
               "mixtral": (MixtralConfig, MixtralForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}


def tiny_family(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random fp32 Hugging Face model of ``family`` (a key of HF_FAMILIES), initialised as ``tiny_llama``."""
    config_cls, model_cls = HF_FAMILIES[family]
    torch.manual_seed(seed)
    return _randomized(model_cls(config_cls(**{**TINY, **overrides})), seed)


# Each family's tiny model for the end-to-end tests: three layers, SmolLM2's vocabulary (its tokenizer is saved beside
# the weights), and what sets the family apart switched on where a config may leave it off: Llama 3's RoPE scaling
# (past 64 positions), Qwen2's sliding window on its layers from 1 on, Mistral's and Phi-3's on every layer, Gemma 2's
# on layers 0 and 2; windows of 8 keys, shorter than the prompts. Gemma 2's caps bind on these weights (its defaults,
# 50 and 30, would hardly ever; its logits reach ~10 uncapped) and its attention scale is not the head size's. (Its
# head stays untied: tied to these random embeddings, scaled by sqrt(hidden), it would only repeat the last token.)
# The mixtures of experts have 8 experts of which each token takes 2: Mixtral's weights renormalized and its window on
# every layer; Qwen3-MoE's not renormalized (its default), with narrower experts and layer 1 a dense MLP.
FAMILY_OVERRIDES = {
    "llama": {"rope_parameters": LLAMA3_ROPE},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 8},
    "phi3": {"sliding_window": 8},
    "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 8.0},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8},
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "mlp_only_layers": [1]},
}


def save_family_dir(directory: Path, family: str, hf_tokenizer) -> torch.nn.Module:
    """Writes the tiny ``family`` model (FAMILY_OVERRIDES) as a Hugging Face directory (safetensors, config.json,
    generation_config.json) with ``hf_tokenizer`` (a transformers tokenizer, its chat template included) beside it;
    returns the Hugging Face model."""
    hf = tiny_family(family, num_hidden_layers=3, vocab_size=len(hf_tokenizer), bos_token_id=hf_tokenizer.bos_token_id,
                     eos_token_id=hf_tokenizer.eos_token_id, **FAMILY_OVERRIDES[family])
    hf.save_pretrained(directory, safe_serialization=True)
    hf_tokenizer.save_pretrained(directory)
    return hf


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases, large enough to matter
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:  # Linear [out, in], or stacked experts [experts, out, in]
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return model


@torch.no_grad()
def hf_logits(model: HFLlama, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """[T, vocab] float32 logits of one sequence."""
    ids = torch.as_tensor(ids).view(1, -1)
    return model(input_ids=ids).logits[0].float()


# --- driving our model through the real ModelRunner's batch building, without a scheduler ---


@dataclass
class SeqStep:
    """One sequence's share of a step: its new tokens, how many it already has in the cache, and its blocks."""

    new_tokens: list[int]
    num_computed: int
    blocks: list[int]


def new_runner(model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype) -> ModelRunner:
    """The engine's ModelRunner over ``model``, with its own KV cache of ``num_blocks`` blocks."""
    return ModelRunner(model, num_blocks, block_size, dtype, "cpu")


def build_step(runner: ModelRunner, seqs: list[SeqStep]) -> tuple[StepInputs, list[int]]:
    """The runner's flat batch for ``seqs`` (as the scheduler would hand them over), and each sequence's last-token
    row in it (in ``seqs`` order)."""
    out = SchedulerOutput()
    for i, s in enumerate(seqs):
        # Tokens before the new ones are only counted (their KV is in the cache), so zeros stand in for them.
        request = Request(f"seq{i}", [0] * s.num_computed + list(s.new_tokens), SamplingParams(max_tokens=1),
                          max_tokens=1, num_computed_tokens=s.num_computed, block_ids=list(s.blocks))
        out.scheduled.append(request)
        out.num_scheduled_tokens[request.request_id] = len(s.new_tokens)
    inputs = runner.prepare_inputs(out)
    last = [inputs.rows[f"seq{i}"] + len(s.new_tokens) - 1 for i, s in enumerate(seqs)]
    return inputs, last


@torch.inference_mode()
def run_step(runner: ModelRunner, seqs: list[SeqStep], last_only: bool = False) -> list[torch.Tensor]:
    """One forward over the flat batch; each sequence's float32 logits [len(new_tokens), vocab] (or [1, vocab] with
    ``last_only``), in ``seqs`` order."""
    inputs, last = build_step(runner, seqs)
    model = runner.model
    hidden = model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta)
    if last_only:
        return list(model.compute_logits(hidden[torch.tensor(last)]).float().unsqueeze(1))
    logits = model.compute_logits(hidden).float()
    return [logits[end - len(s.new_tokens) + 1: end + 1] for s, end in zip(seqs, last)]


@torch.inference_mode()
def full_logits(model: torch.nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """[T, vocab] float32 logits of one sequence from an empty cache, in one prefill."""
    num_blocks = -(-len(ids) // block_size)
    runner = new_runner(model, num_blocks, block_size, embedding_dtype(model.embed_tokens))
    return run_step(runner, [SeqStep(list(ids), 0, list(range(num_blocks)))])[0]


# --- GGUF files as llama.cpp's converter writes them ---

QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# gguf-py can dequantize these but its quantize() raises NotImplementedError; tests synthesize random valid blocks.
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of each block's float16 scale fields (d, dmin), from gguf.quants' block layouts.
_K_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    # Phi-3's fused tensors (ffn_up holds gate and up)
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    # a mixture of experts' router and stacked experts (gate_up_proj is written as ffn_gate_exps and ffn_up_exps)
    "mlp.gate": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps",
}
# Gemma's four norms a layer.
_GGUF_GEMMA_LAYER = {**_GGUF_LAYER, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


# llama.cpp's general.architecture for each Hugging Face model_type (its converter writes Mistral as "llama").
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "mixtral": "llama", "qwen3_moe": "qwen3moe"}


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name of a Hugging Face tensor (``.weight`` or ``.bias``; transformers' stacked experts have no
    suffix and get ``.weight``)."""
    if hf_name.endswith(".experts.down_proj"):
        hf_name += ".weight"
    name, _, kind = hf_name.removeprefix("model.").rpartition(".")
    if name.startswith("layers."):
        _, layer, sub = name.split(".", 2)
        return f"blk.{layer}.{(_GGUF_GEMMA_LAYER if arch == 'gemma2' else _GGUF_LAYER)[sub]}.{kind}"
    return {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[name] + f".{kind}"


def gguf_tokenizer_fields(path: Path) -> list[tuple]:
    """(key, value, type, item type) of every ``tokenizer.*`` key of the GGUF file ``path``, to write into another."""
    header = GGUFContents(path)
    return [(key, header.value(key), gguf.GGUFValueType(f.type),
             None if f.item_type is None else gguf.GGUFValueType(f.item_type))
            for key, f in header.fields.items() if key.startswith("tokenizer.")]


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotate-half → interleaved pairs)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Stored bytes (or float array) for ``w`` in ``qtype``. K-quants cannot be quantized by gguf-py: for them the
    result is random valid blocks whose dequantized values have ``w``'s shape and standard deviation, not its values."""
    t = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32)
    if qtype not in _K_F16_FIELDS:
        return gguf.quants.quantize(w.astype(np.float32), t)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t]
    rows, cols = w.shape
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.0, size=(blocks.shape[0], len(_K_F16_FIELDS[qtype])))

    def with_scales(factor: float) -> np.ndarray:
        out = blocks.copy()
        for j, offset in enumerate(_K_F16_FIELDS[qtype]):
            out[:, offset:offset + 2] = (scales[:, j] * factor).astype(np.float16)[:, None].view(np.uint8)
        return out.reshape(rows, -1)

    # Dequantized values are linear in the block scales: rescale them once to reach w's spread.
    probe = gguf.quants.dequantize(with_scales(1.0), t)
    return with_scales(float(w.std()) / float(probe.std()))


def write_gguf(path: Path, hf: HFLlama, qtype: str, seed: int = 0,
               tokenizer: list[tuple] | None = None) -> dict[str, np.ndarray]:
    """Writes ``hf`` (a Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma 2) as llama.cpp's converter would: its
    architecture and tensor names (GGUF_ARCH), 2-D weights in ``qtype``, norms and biases in F32, q/k rows permuted
    for "llama" only, no sliding window for Llama, Mistral and Qwen (the converter writes none for these), RoPE
    scaling as the converter records it (linear: header keys; llama3: a ``rope_freqs`` tensor; Phi-3's LongRoPE: the
    ``rope_factors_long/short`` tensors, the original context and attention factor in the header), Phi-3's fused
    q/k/v and gate/up as they are, Gemma 2's norms as 1 + w, caps and window in the header and no head (the
    converter drops it: the file is tied), and the ``tokenizer`` fields (gguf_tokenizer_fields) if given.
    Returns the weights the file really holds, under Hugging Face names, dequantized and un-permuted (what a correct
    loader must produce)."""
    cfg = hf.config
    arch = GGUF_ARCH[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Qwen2's config has none
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.model_type}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # Mixtral's experts are feed_forward_length wide, Qwen3-MoE's have their own width
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "phi3":  # 0: no window
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    if arch == "gemma2":  # head_dim always, the caps and window; no RoPE base (llama.cpp's default, 10000)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    elif rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope))
    elif rope.get("rope_type", "default") != "default":
        raise NotImplementedError(rope)
    for key, value, vtype, item_type in tokenizer or []:
        w.add_key_value(key, value, vtype, sub_type=item_type)
    stored: dict[str, np.ndarray] = {}
    for hf_name, param in hf.state_dict().items():
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or arch == "gemma2"):
            continue
        array = param.detach().float().numpy()
        if array.ndim == 1:
            shift = 1.0 if arch == "gemma2" and hf_name.endswith("norm.weight") else 0.0
            w.add_tensor(gguf_tensor_name(hf_name, arch), array + shift)
            stored[hf_name] = (array + shift) - shift  # what a loader reads back
            continue
        if hf_name.endswith(".experts.gate_up_proj"):  # llama.cpp stores the gate and up halves apart
            width = array.shape[1] // 2
            halves = []
            for half, suffix in ((array[:, :width], "gate"), (array[:, width:], "up")):
                data = encode(half, qtype, rng)
                t = GGMLQuantizationType[qtype]
                layer = hf_name.removeprefix("model.").split(".")[1]
                w.add_tensor(f"blk.{layer}.ffn_{suffix}_exps.weight", data, raw_dtype=None if qtype == "F32" else t)
                halves.append(gguf.quants.dequantize(data, t).reshape(half.shape).astype(np.float32))
            stored[hf_name] = np.concatenate(halves, axis=1)
            continue
        n_head = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
        permuted = arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name)
        if permuted:
            array = permute_rope(array, n_head)
        data = encode(array, qtype, rng)
        t = GGMLQuantizationType[qtype]
        w.add_tensor(gguf_tensor_name(hf_name, arch), data, raw_dtype=None if qtype == "F32" else t)
        values = gguf.quants.dequantize(data, t).reshape(array.shape).astype(np.float32)
        stored[hf_name] = unpermute_rope(values, n_head) if permuted else values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs.weight`` for Llama 3.1+ models
    (convert_hf_to_gguf.py, llama.cpp PR #8676): llama.cpp divides each rotary frequency by its factor."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
