"""ModelConfig: the shape of a model (what its weights and layers are), read from a GGUF header or a config.json
(model/gguf_file.py, model/hf_config.py). The engine's settings are serval/config.py's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Shape of a Llama-family transformer, read from a GGUF header or a config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF form: {"rope_type": "llama3" | "linear", "factor": ..., ...}
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"
    name: str = ""
    # Gemma 2 and 3: most layers attend to a sliding window of keys (Gemma 3's with their own RoPE base);
    # "sliding_attention" or "full_attention" per layer; attention scaled by query_pre_attn_scalar^-0.5; logits
    # soft-capped, and (Gemma 2) attention scores too: cap * tanh(x / cap).
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Options of the Llama decoder that other families turn on (model/hf_config.py): biases on the q/k/v projection
    # (Qwen2), a per-head RMSNorm of queries and keys before RoPE (Qwen3; Gemma 3's layers too). A layer whose
    # ``layer_types`` entry is "sliding_attention" sees the last ``sliding_window`` keys (Mistral, Phi-3, windowed
    # Qwen, Gemma).
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE; layers/moe.py): the layers listed in ``moe_layers`` replace the MLP by
    # ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, of which a router picks
    # ``num_experts_per_tok`` per token, their weights renormalized to sum to 1 if ``norm_topk_prob``. A rank under
    # expert parallelism holds only the experts [start, end) of ``local_experts`` (None: all).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None
    local_experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be 1 to num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok!r}")
        if self.moe_layers and self.moe_intermediate_size < 1:
            raise ValueError(f"ModelConfig.moe_intermediate_size must be positive, got {self.moe_intermediate_size!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

