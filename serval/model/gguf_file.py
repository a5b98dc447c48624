"""Reads a GGUF file of an architecture llama.cpp writes (llama, which Mistral is written as too; qwen2; qwen3; phi3;
gemma2; gemma3): its header as a ModelConfig, its tensors dequantized under Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from serval.config import ModelConfig
from serval.layers.linear import BlockWeight

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's layers: its norms have other names (and llama.cpp stores each norm's w as 1 + w).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Qwen3's layers: Qwen2's (whose q/k/v biases are blk.N.attn_{q,k,v}.bias) and a per-head RMSNorm of q and k.
_QWEN3_LAYER_NAMES = {**_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Phi-3's layers: q/k/v stored fused as attn_qkv and gate/up fused as ffn_up, under the fused Hugging Face names
# (load_model splits them into Llama's parts, model/llama.py split_fused_weights).
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 2's layers have Gemma 3's four norms (also stored as 1 + w) and no q/k norms.
_ARCH_LAYER_NAMES = {"llama": _LAYER_NAMES, "qwen2": _LAYER_NAMES, "qwen3": _QWEN3_LAYER_NAMES,
                     "phi3": _PHI3_LAYER_NAMES, "gemma2": _GEMMA3_LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES}
# general.architecture values that load. llama.cpp's converter writes MistralForCausalLM as "llama" and keeps no
# sliding window (its LlamaModel has no such key; llama.cpp then attends to every key, and so does this loader).
ARCHITECTURES = tuple(_ARCH_LAYER_NAMES)
# Only for "llama" does the converter interleave each head's q/k rows (llama.cpp's RoPE there rotates adjacent
# pairs); the others run NEOX RoPE on rows stored as Hugging Face has them (rotate-half).
_ROPE_PERMUTED = ("llama",)
# GGUF block types that the block kernel reads as stored: bytes per block of 32 weights.
BLOCK_FORMATS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


class GGUFModelFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: architecture {self.architecture!r} is not supported "
                             f"({', '.join(ARCHITECTURES)})")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def model_config(self) -> ModelConfig:
        arch = self.architecture
        hidden = int(self.field(f"{arch}.embedding_length"))
        heads = int(self.field(f"{arch}.attention.head_count"))
        names = {t.name for t in self.reader.tensors}
        vocab = self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        scaling = None
        kind = self.field(f"{arch}.rope.scaling.type")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(self.field(f"{arch}.rope.scaling.factor"))}
        elif kind not in (None, "none"):  # e.g. yarn (long-context Qwen2.5 files): refused, not silently dropped
            raise ValueError(f"{self.path.name}: rope scaling {kind!r} is not supported (linear, llama3's rope_freqs)")
        freqs = self._vector("rope_freqs.weight")
        if freqs is not None:
            # llama.cpp stores Llama 3.1+ RoPE scaling as one divisor per rotary frequency, not in the header.
            scaling = {"rope_type": "divisors", "divisors": freqs}
        long_factors = self._vector("rope_factors_long.weight")
        if long_factors is not None:
            # Phi-3's LongRoPE: the two factor lists as tensors, the original context and cos/sin factor in the header.
            original = int(self.field(f"{arch}.rope.scaling.original_context_length"))
            scaling = {"rope_type": "longrope", "long_factor": long_factors,
                       "short_factor": self._vector("rope_factors_short.weight"),
                       "original_max_position_embeddings": original}
            attention_factor = self.field(f"{arch}.rope.scaling.attn_factor")
            if attention_factor is not None:
                scaling["attention_factor"] = float(attention_factor)
        num_layers = int(self.field(f"{arch}.block_count"))
        window = self.field(f"{arch}.attention.sliding_window")
        extra = {}
        if arch == "phi3" and window:
            # Every layer slides, as transformers runs Phi-3 (llama.cpp has turned Phi's window off for now; 0 is its
            # writer's "none", for Phi-4).
            extra = dict(layer_types=["sliding_attention"] * num_layers, sliding_window=int(window))
        elif arch == "gemma2":
            head_dim = int(self.field(f"{arch}.attention.key_length", hidden // heads))
            # Layers 0, 2, 4, ... slide. The header has no query_pre_attn_scalar: llama.cpp scales by the head size,
            # but by hidden / heads for the 27B model (46 layers), as each model's config.json says.
            extra = dict(layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(num_layers)],
                         sliding_window=int(window) if window else 4096,  # (transformers' default)
                         query_pre_attn_scalar=float(hidden // heads if num_layers == 46 else head_dim),
                         final_logit_softcapping=self.field(f"{arch}.final_logit_softcapping"),
                         attn_logit_softcapping=self.field(f"{arch}.attn_logit_softcapping"))
        elif arch == "gemma3":
            # Not in the header: Gemma 3's fixed choices (a global layer every 6th, local RoPE base 10000, scale
            # by the head size), as llama.cpp and transformers assume them for these files.
            extra = dict(layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                      for i in range(num_layers)],
                         sliding_window=int(window),
                         rope_local_theta=10000.0,
                         query_pre_attn_scalar=float(self.field(f"{arch}.attention.key_length", hidden // heads)),
                         final_logit_softcapping=self.field(f"{arch}.final_logit_softcapping"))
        return ModelConfig(
            **extra,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{arch}.feed_forward_length")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(self.field(f"{arch}.attention.key_length", hidden // heads)),
            max_position=int(self.field(f"{arch}.context_length")),
            rms_norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            architecture=arch,
            name=str(self.field("general.name", self.path.stem)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),  # per-head q/k RMSNorm
        )

    def _vector(self, name: str) -> list[float] | None:
        """The values of the 1-D tensor ``name`` (RoPE factors), or None where the file has none."""
        tensor = next((t for t in self.reader.tensors if t.name == name), None)
        if tensor is None:
            return None
        values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        return np.array(values, dtype=np.float64).reshape(-1).tolist()

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) pairs. q/k rows of "llama" files are put back from llama.cpp's RoPE
        order."""
        for tensor in self.reader.tensors:
            qtype = GGMLQuantizationType(tensor.tensor_type)
            if qtype.name not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path.name}: tensor {tensor.name} has unsupported type {qtype.name}")
            name = _hf_name(tensor.name, self.architecture)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape))
            array = np.array(dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape)
            weight = torch.from_numpy(array)
            if self.architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # stored as 1 + w
                weight = weight - 1
            elif self.architecture in _ROPE_PERMUTED and name.endswith("q_proj.weight"):
                weight = _unpermute_rope(weight, config.num_heads)
            elif self.architecture in _ROPE_PERMUTED and name.endswith("k_proj.weight"):
                weight = _unpermute_rope(weight, config.num_kv_heads)
            yield name, weight


    def block_weights(self, config: ModelConfig) -> Iterator[tuple[str, BlockWeight]]:
        """(Hugging Face name, BlockWeight) of every matrix stored as Q4_0, Q4_1 or Q8_0: its blocks as stored,
        repacked without loss for the block kernel (rows put back from llama.cpp's RoPE order like weights())."""
        for tensor in self.reader.tensors:
            qtype = GGMLQuantizationType(tensor.tensor_type)
            name = _hf_name(tensor.name, self.architecture)
            if name is None or qtype.name not in BLOCK_FORMATS or len(tensor.shape) != 2:
                continue
            in_features, out_features = (int(d) for d in tensor.shape)
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
            weight = _to_block_weight(qtype.name, raw.reshape(out_features, in_features // 32, -1), in_features)
            if self.architecture in _ROPE_PERMUTED and name.endswith("q_proj.weight"):
                weight = _unpermute_blocks(weight, config.num_heads)
            elif self.architecture in _ROPE_PERMUTED and name.endswith("k_proj.weight"):
                weight = _unpermute_blocks(weight, config.num_kv_heads)
            yield name, weight


def _to_block_weight(qtype: str, raw: torch.Tensor, in_features: int) -> BlockWeight:
    """raw [N, G, bytes]: GGUF blocks (float16 d, [float16 m,] quants) as the block kernel's q4/q8 layout."""
    if qtype == "Q4_1":  # d, m, 16 bytes of nibbles: already the kernel's layout
        weight = BlockWeight("q4", raw[..., 4:], raw[..., :4].contiguous().view(torch.int16), in_features)
    elif qtype == "Q4_0":  # d, nibbles; w = d (q - 8) = d q + m with m = -8 d (exact in float16)
        d = raw[..., :2].contiguous().view(torch.float16)
        scales = torch.cat([d, d * -8], dim=-1).view(torch.int16)
        weight = BlockWeight("q4", raw[..., 2:], scales, in_features)
    else:  # Q8_0: d, 32 signed bytes
        weight = BlockWeight("q8", raw[..., 2:], raw[..., :2].contiguous().view(torch.int16), in_features)
    return BlockWeight(weight.format, weight.packed.contiguous(), weight.scales.contiguous(), in_features)


def _unpermute_blocks(weight: BlockWeight, num_heads: int) -> BlockWeight:
    return BlockWeight(weight.format, _unpermute_rope(weight.packed, num_heads),
                       _unpermute_rope(weight.scales, num_heads), weight.in_features)


def _hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        sub = _ARCH_LAYER_NAMES[architecture].get(m.group(2))
        return None if sub is None else f"model.layers.{m.group(1)}.{sub}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        base = _GLOBAL_NAMES[m.group(1)]
        return f"{base}.weight" if base == "lm_head" else f"model.{base}.weight"
    return None  # e.g. rope_freqs, rope_factors_*: read into the config, not loaded


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's two rotary halves; undo it for the rotate-half layout.
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)
