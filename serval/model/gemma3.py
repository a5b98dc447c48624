"""Gemma 2 and Gemma 3 (text): Llama's skeleton with Gemma's parts, one definition for both.

- embeddings scaled by sqrt(hidden) (rounded to the model's dtype first, as the reference does);
- RMSNorm as ``x * (1 + w)`` in float32, and four norms a layer: before and after attention, before and after the
  MLP, each sublayer's output normed before it joins the residual stream;
- attention scaled by query_pre_attn_scalar^-0.5;
- interleaved attention: some layers see a sliding window of the last ``sliding_window`` keys, the others see
  everything (``layer_types``: Gemma 2 alternates them, Gemma 3 has one global layer in six);
- GeGLU MLP (gelu with the tanh approximation), and logit soft-capping where the config has it.

What sets them apart is in the config (``ModelConfig``): Gemma 3 norms each head's queries and keys before RoPE
(``qk_norm``) and rotates its local layers with their own RoPE base (``rope_local_theta``); Gemma 2 soft-caps the
attention scores (``attn_logit_softcapping``, passed to whichever attention backend runs, the C++ CPU kernel
included).
"""

from __future__ import annotations

import torch
from torch import nn

from serval.layers.activation import exact_gelu_lanes, gelu_tanh_and_mul
from serval.layers.attention import AttentionMetadata, paged_attention
from serval.layers.attention.cpu_kernel import CpuKernelMetadata
from serval.layers.embedding import dense_embedding
from serval.layers.linear import BlockQuantLinear, Linear
from serval.layers.norm import GemmaRMSNorm, exact_sum_lanes
from serval.layers.rotary import RotaryEmbedding, RotaryStep
from serval.model.config import ModelConfig
from serval.model.llama import LlamaForCausalLM, LlamaMLP


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.sliding_window if sliding else None
        self.softcap = config.attn_logit_softcapping

    def forward(self, rope: RotaryStep, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head's queries and keys, as views into qkv (a C++ pass each on the CPU)
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotated in place, each on its own: no concatenated copy and no split of it (small ops that decode pays for).
        q, k = rope.rotate_(q), rope.rotate_(k)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window,
                              softcap=self.softcap)
        return self.o_proj(out.flatten(1))


class Gemma3MLP(LlamaMLP):
    """Llama's MLP with GeGLU (gelu, tanh approximation) for SwiGLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        # csrc/decoder_layers.cpp's GemmaLayer over this layer's weights, as LlamaDecoderLayer.cpu_layer: the Python
        # path's kernel calls in one, built on the first CPU-kernel step; False where some part would take PyTorch's
        # lines here (a width or dtype without an exact C++ pass) or is not a block linear. It takes the layer's
        # settings (window, scale, heads) when built: who changes one sets this to None.
        self.cpu_layer = None

    def forward(self, rope: RotaryStep, x: torch.Tensor, residual: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, next_norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: input_layernorm(residual), normed by the layer before; returns (next_norm(r), r) for the new residual
        stream r. Each sublayer's output is normed, added and the next input normed in one call (one pass on the
        CPU): the reference's x + post_norm(sublayer(pre_norm(x))) twice."""
        if (rope.kernels is not None and type(meta) is CpuKernelMetadata and x.is_contiguous()
                and residual.is_contiguous()):
            cpu_layer = self.cpu_layer if self.cpu_layer is not None else self._build_cpu_layer(rope.kernels, x.dtype)
            if cpu_layer:
                return cpu_layer(x, residual, next_norm.weight, rope.positions, rope.table.cos, rope.table.sin,
                                 kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables, meta.token_table,
                                 meta.context_lens)
        attended = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_to(attended, residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_to(self.mlp(x), residual, next_norm)

    def _build_cpu_layer(self, kernels, dtype: torch.dtype):
        """The GemmaLayer for this layer and the model's ``dtype`` (kept in ``cpu_layer``), None until its linears
        have built their kernels, False (for good) where it cannot run this layer as the Python path does."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = [self.post_attention_layernorm, self.pre_feedforward_layernorm, self.post_feedforward_layernorm]
        head_lanes = exact_sum_lanes(kernels, attn.head_dim, dtype) if attn.q_norm is not None else 0
        hidden_lanes = exact_sum_lanes(kernels, norms[0].weight.shape[0], dtype)
        gelu_lanes = exact_gelu_lanes(kernels, mlp.intermediate_size, dtype)
        weights = [norm.weight for norm in norms + [attn.q_norm, attn.k_norm] if norm is not None]
        if (not all(type(linear) is BlockQuantLinear for linear in linears) or None in (head_lanes, hidden_lanes,
                                                                                         gelu_lanes)
                or any(weight.dtype != dtype for weight in weights)):
            self.cpu_layer = False
            return False
        if any(linear.kernel is None for linear in linears):
            return None
        self.cpu_layer = kernels.GemmaLayer(
            *(linear.kernel for linear in linears), None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight, *(norm.weight for norm in norms), norms[0].eps,
            head_lanes, hidden_lanes, gelu_lanes, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
            attn.window or 0, attn.softcap or 0.0)
        return self.cpu_layer


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads, fuses and ties weights as the Llama model does (same Hugging Face names); its own layers and step."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta, config.rope_scaling)
        self.rotary_local = RotaryEmbedding(config.head_dim, config.max_position,
                                            config.rope_local_theta or config.rope_theta)
        self.embed_tokens = dense_embedding(config.vocab_size, config.hidden_size)
        kinds = config.layer_types or ["full_attention"] * config.num_layers
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, sliding=kind == "sliding_attention") for kind in kinds)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_weights()
        self.cpu_layers: tuple[tuple, object] | None = None  # (the layers' one-call forms, GemmaLayers over them)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        global_rope = self.rotary.for_step(positions, x.dtype)
        local_rope = self.rotary_local.for_step(positions, x.dtype)
        residual, x = x, self.layers[0].input_layernorm(x)
        cpu_layers = self._cpu_layers(global_rope, x, kv_caches, meta) if residual.is_contiguous() else None
        if cpu_layers is not None:
            return cpu_layers(x, residual, global_rope.positions, global_rope.table.cos, global_rope.table.sin,
                              local_rope.table.cos, local_rope.table.sin, kv_caches, meta.slot_mapping,
                              meta.block_tables, meta.token_table, meta.context_lens)[0]
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, kv_cache, next_norm in zip(self.layers, kv_caches, next_norms):
            x, residual = layer(local_rope if layer.sliding else global_rope, x, residual, kv_cache, meta, next_norm)
        return x

    def _layers_in_one_call(self, kernels, forms: tuple) -> object:
        next_norms = [layer.input_layernorm.weight for layer in self.layers[1:]] + [self.norm.weight]
        return kernels.GemmaLayers(list(forms), next_norms, [layer.sliding for layer in self.layers])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
