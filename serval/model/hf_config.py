"""Reads a Hugging Face model directory's config.json as a ModelConfig, per architecture.

Every family here but Gemma 2 is the Llama decoder (model/llama.py) with the options its config turns on; Gemma 2
is the Gemma decoder (model/gemma3.py) without Gemma 3's options:

| ``architectures``  | family  | GGUF (gguf_file.py) | options                                                         |
|--------------------|---------|---------------------|-----------------------------------------------------------------|
| LlamaForCausalLM   | llama   | llama               | rope scaling (llama3, linear; GGUF: rope_freqs)                 |
| MistralForCausalLM | mistral | llama, no window    | every layer sees the last ``sliding_window`` keys (when set)    |
| Qwen2ForCausalLM   | qwen2   | qwen2               | q/k/v biases; sliding layers from ``max_window_layers`` on if   |
|                    |         |                     | ``use_sliding_window``                                          |
| Qwen3ForCausalLM   | qwen3   | qwen3               | per-head q/k RMSNorm; sliding layers as Qwen2                   |
| Phi3ForCausalLM    | phi3    | phi3                | q/k/v and gate/up stored fused; LongRoPE scaling (GGUF: the     |
|                    |         |                     | rope_factors_long/short tensors); sliding window as Mistral     |
| Gemma2ForCausalLM  | gemma2  | gemma2              | attention and final logit soft-capping; sliding and global      |
|                    |         |                     | layers alternate                                                |
| MixtralForCausalLM | mixtral | -                   | every MLP a mixture of experts (layers/moe.py); sliding window  |
|                    |         |                     | as Mistral                                                      |
| Qwen3MoeForCausalLM | qwen3_moe | -               | Qwen3's q/k RMSNorm; MoE MLPs but in ``mlp_only_layers`` and  |
|                    |         |                     | off ``decoder_sparse_step``; sliding window on every layer if   |
|                    |         |                     | ``use_sliding_window``                                          |

Routing as each defines it: Mixtral a softmax over all experts, the top k, renormalized to sum to 1; Qwen3-MoE the
same, renormalized only if ``norm_topk_prob``.
"""

from __future__ import annotations

import json
from pathlib import Path

from serval.model.config import ModelConfig
from serval.model.gguf_file import ARCHITECTURES as GGUF_ARCHITECTURES

# config.json's ``architectures`` (or, without it, ``model_type``) → family.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                 "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
_MODEL_TYPES = {family: family for family in ARCHITECTURES.values()}


def read_hf_config(path: Path) -> ModelConfig:
    """The ModelConfig of the directory ``path``; a ValueError names an architecture or option it cannot run."""
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or [raw.get("model_type", "")]
    family = ARCHITECTURES.get(archs[0]) or _MODEL_TYPES.get(archs[0])
    if family is None:
        raise ValueError(f"{path}: architecture {archs[0]!r} is not supported (safetensors directories: "
                         f"{', '.join(ARCHITECTURES)}; GGUF files: {', '.join(GGUF_ARCHITECTURES)})")
    if raw.get("attention_bias") and family != "qwen2":
        # Llama's and Qwen3's flag also puts a bias on o_proj, which the decoder does not have.
        raise ValueError(f"{path}: attention_bias is not supported for {archs[0]}")
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    if raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor is not supported (RoPE rotates whole heads)")
    eos = raw.get("eos_token_id")
    num_layers = raw["num_hidden_layers"]
    window, layer_types = _sliding_layers(raw, family, num_layers)
    gemma2 = family == "gemma2"
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(raw, family),
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma2),  # transformers' defaults
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        architecture=family,
        name=path.name,
        layer_types=layer_types,
        sliding_window=window,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        **_experts(raw, family, num_layers),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma2 else None,
        # transformers' defaults where a Gemma 2 config.json leaves them out; null there turns a cap off.
        final_logit_softcapping=raw.get("final_logit_softcapping", 30.0) if gemma2 else None,
        attn_logit_softcapping=raw.get("attn_logit_softcapping", 50.0) if gemma2 else None,
    )


def _rope_scaling(raw: dict, family: str) -> dict | None:
    """The HF-form rope scaling dict RotaryEmbedding reads, or None for plain RoPE. Phi-3's LongRoPE ("su" and "yarn"
    in older files, as transformers reads them) also needs the original context, which older files keep beside it."""
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if family != "phi3" or scaling is None:
        return scaling
    if (scaling.get("rope_type") or scaling.get("type")) not in ("longrope", "su", "yarn"):
        raise ValueError(f"Phi-3 rope scaling {scaling!r} is not supported (longrope only)")
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", 4096))
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}


def _sliding_layers(raw: dict, family: str, num_layers: int) -> tuple[int | None, list[str] | None]:
    """(window, each layer's "sliding_attention" or "full_attention"), or (None, None) with no sliding layers.

    transformers 5 writes ``layer_types``; older config.json files (most checkpoints on disk) have only Mistral's
    ``sliding_window``, or Qwen's ``use_sliding_window`` (often false beside a ``sliding_window`` value that then
    means nothing) and ``max_window_layers``, which the rules below turn into the same list."""
    window = raw.get("sliding_window", 4096 if family == "gemma2" else None)  # (transformers' Gemma 2 default)
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if family == "llama" or window is None:
        return None, None
    layer_types = raw.get("layer_types")
    if layer_types is None and family in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        layer_types = ["sliding_attention"] * num_layers
    elif layer_types is None and family == "gemma2":  # layers 0, 2, 4, ... slide
        layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)]
    elif layer_types is None:
        first = raw.get("max_window_layers", 28)  # transformers' default for both Qwen configs
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return window, list(layer_types)


def _experts(raw: dict, family: str, num_layers: int) -> dict:
    """The mixture-of-experts fields of ModelConfig (none for a dense family), with transformers' defaults where
    config.json leaves a field out. Older files name the expert count ``num_experts`` (Qwen3-MoE), newer ones
    ``num_local_experts`` for both families."""
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    mixtral = family == "mixtral"
    experts = raw.get("num_local_experts", raw.get("num_experts", 8 if mixtral else 128))
    if mixtral:  # every layer's MLP, each expert as wide as ``intermediate_size``
        layers, width, renormalize = list(range(num_layers)), raw["intermediate_size"], True
    else:
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
        layers = [i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0]
        width, renormalize = raw.get("moe_intermediate_size", 768), raw.get("norm_topk_prob", False)
    return dict(num_experts=experts, num_experts_per_tok=raw.get("num_experts_per_tok", 2 if mixtral else 8),
                moe_intermediate_size=width, norm_topk_prob=renormalize, moe_layers=layers)
