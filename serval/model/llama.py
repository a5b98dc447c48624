"""The Llama decoder (Llama 2/3, SmolLM, ...): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Qwen2/2.5, Qwen3, Mistral and Phi-3 are this decoder with options that their config.json turns on
(model/hf_config.py): q/k/v biases (``qkv_bias``), a per-head RMSNorm of queries and keys before RoPE (``qk_norm``),
sliding-window layers (``layer_types`` and ``sliding_window``), LongRoPE (``rope_scaling``), a mixture-of-experts MLP in
the layers of ``moe_layers`` (Mixtral, Qwen3-MoE: layers/moe.py). Phi-3's checkpoints store q/k/v and gate/up fused,
as this decoder holds them: ``split_fused_weights`` names their parts as Llama's, and the experts' tensors under
Qwen3-MoE's per-expert names whatever form the checkpoint stores them in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from serval.layers.activation import silu_and_mul
from serval.layers.attention import AttentionMetadata, paged_attention
from serval.layers.attention.cpu_kernel import CpuKernelMetadata
from serval.layers.embedding import BlockEmbedding, dense_embedding
from serval.layers.linear import BlockQuantLinear, BlockWeight, Linear
from serval.layers.moe import SparseMoE
from serval.layers.norm import RMSNorm
from serval.layers.rotary import RotaryEmbedding, RotaryStep
from serval.model.config import ModelConfig


def split_fused_weights(weights: Iterable[tuple[str, torch.Tensor | BlockWeight]],
                        config: ModelConfig) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    """Checkpoint tensors (or a GGUF file's BlockWeights) with fused ``qkv_proj`` and ``gate_up_proj`` (Phi-3) as
    their q/k/v and gate/up parts under Llama's names (views, no copies), so that every later step of loading
    (tensor-parallel slices, the fusing load) sees one naming; other tensors pass as they are."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    parts = {"self_attn.qkv_proj": [("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size),
                                    ("self_attn.v_proj", kv_size)],
             "mlp.gate_up_proj": [("mlp.gate_proj", config.intermediate_size),
                                  ("mlp.up_proj", config.intermediate_size)]}
    for name, tensor in _expert_weights(weights, config):
        prefix, _, leaf = name.rpartition(".")
        fused = next((f for f in parts if prefix.endswith(f)), None)
        if fused is None or ".experts." in name:
            yield name, tensor
            continue
        names = [prefix.removesuffix(fused) + part for part, _ in parts[fused]]
        sizes = [size for _, size in parts[fused]]
        rows = tensor.out_features if isinstance(tensor, BlockWeight) else tensor.shape[0]
        if rows != sum(sizes):
            raise ValueError(f"weight {name!r}: {rows} rows, not the {sum(sizes)} of its parts")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for part, start, size in zip(names, starts, sizes):
            piece = (tensor.slice(slice(start, start + size)) if isinstance(tensor, BlockWeight)
                     else tensor[start:start + size])
            yield f"{part}.{leaf}", piece


# Mixtral's names of its MoE tensors (hub checkpoints, and what transformers 5 saves) → Qwen3-MoE's.
_MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _expert_weights(weights: Iterable[tuple[str, torch.Tensor]],
                    config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Experts' tensors under one naming, ``mlp.experts.{i}.gate_proj/up_proj/down_proj.weight`` (and the router
    ``mlp.gate.weight``): Mixtral's ``block_sparse_moe.experts.{i}.w1/w3/w2`` renamed, and the stacked 3-D form of
    transformers 5's modules (``mlp.experts.gate_up_proj`` [experts, 2 * width, hidden], ``mlp.experts.down_proj``
    [experts, hidden, width]) split into each expert's views."""
    width = config.moe_intermediate_size
    for name, tensor in weights:
        if "block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj":
            for i, expert in enumerate(tensor):
                yield f"{prefix}.experts.{i}.gate_proj.weight", expert[:width]
                yield f"{prefix}.experts.{i}.up_proj.weight", expert[width:]
        elif leaf == "down_proj":
            for i, expert in enumerate(tensor):
                yield f"{prefix}.experts.{i}.down_proj.weight", expert
        else:
            yield name, tensor


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: one call instead of three per layer and step.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.scale = self.head_dim**-0.5
        # Beside the linear, not in it: a quantized or block-format linear that replaces qkv_proj keeps the bias.
        self.qkv_proj_bias = (nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size), requires_grad=False)
                              if config.qkv_bias else None)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.window = window  # attend to the last ``window`` keys only (a sliding-window layer)

    def forward(self, rope: RotaryStep, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qkv_proj_bias is not None:
            qkv = qkv + self.qkv_proj_bias
        # split_with_sizes, not Tensor.split: the same views without a Python wrapper, twice per layer and step.
        qk, v = qkv.split_with_sizes([self.q_size + self.kv_size, self.kv_size], dim=-1)
        heads = self.num_heads + self.num_kv_heads
        if self.q_norm is None:
            qk = qk.view(-1, heads, self.head_dim)
        else:  # each head's query and key normed on its own, before RoPE
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(-1, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(-1, self.num_kv_heads, self.head_dim)
            qk = torch.cat([q, k], dim=1)
        # Queries and keys rotate in one call, in place: fewer small ops per layer, which batch-1 decode pays for.
        qk = rope.rotate_(qk)
        q, k = qk.split_with_sizes([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None = None, sparse: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, config.norm_topk_prob, config.local_experts)
                    if sparse else LlamaMLP(config))

        # csrc/decoder_layers.cpp's LlamaLayer over this layer's weights: its kernel calls in one call from Python, with
        # the Python path's bits. Built on the first CPU-kernel step after the block linears built their kernels;
        # False where this layer has parts it does not run (biases, q/k norms, experts, other linears), and for a
        # layer that a caller sets to False (tests compare the two paths). It takes the layer's settings (window,
        # scale, heads) when built: who changes one sets this to None.
        self.cpu_layer = None

    def forward(self, rope: RotaryStep, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added); the next norm adds the two."""
        if (rope.kernels is not None and type(meta) is CpuKernelMetadata and x.is_contiguous()
                and (residual is None or residual.is_contiguous())):  # the C++ norm reads both in place
            cpu_layer = self.cpu_layer if self.cpu_layer is not None else self._build_cpu_layer(rope.kernels)
            if cpu_layer:
                return cpu_layer(x, residual, rope.positions, rope.table.cos, rope.table.sin, kv_cache[0], kv_cache[1],
                                 meta.slot_mapping, meta.block_tables, meta.token_table, meta.context_lens)
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h, kv_cache, meta), residual)
        return self.mlp(h), residual

    def _build_cpu_layer(self, kernels):
        """The LlamaLayer for this layer (kept in ``cpu_layer``), None until its linears have built their kernels,
        False (for good) where it cannot run this layer."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
        if (attn.qkv_proj_bias is not None or attn.q_norm is not None
                or not isinstance(mlp, LlamaMLP) or not all(type(linear) is BlockQuantLinear for linear in linears)
                or not all(type(norm) is RMSNorm for norm in (self.input_layernorm, self.post_attention_layernorm))):
            self.cpu_layer = False
            return False
        if any(linear.kernel is None for linear in linears):
            return None
        self.cpu_layer = kernels.LlamaLayer(
            self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
            *(linear.kernel for linear in linears), attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
            attn.window or 0)
        return self.cpu_layer


def use_cpu_layers(model: nn.Module, enabled: bool) -> int:
    """Whether ``model``'s layers run as one C++ call each where the CPU kernels run (``cpu_layer`` of
    LlamaDecoderLayer and gemma3.py's Gemma3DecoderLayer; EngineConfig.enforce_eager turns it off): each builds its
    C++ layer anew on its next step, or keeps to the Python path. Returns how many layers it set."""
    layers = [m for m in model.modules() if hasattr(m, "cpu_layer")]
    for layer in layers:
        layer.cpu_layer = None if enabled else False
    return len(layers)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta, config.rope_scaling)
        self.embed_tokens = dense_embedding(config.vocab_size, config.hidden_size)
        kinds = config.layer_types or ["full_attention"] * config.num_layers
        sparse = set(config.moe_layers or ())
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, config.sliding_window if kind == "sliding_attention" else None, i in sparse)
            for i, kind in enumerate(kinds))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_weights()
        self.cpu_layers: tuple[tuple, object] | None = None  # (the layers' one-call forms, LlamaLayers over them)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat token batch. ``kv_caches[i]`` is layer i's [2, blocks, ...] cache."""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.for_step(positions, x.dtype)
        cpu_layers = self._cpu_layers(rope, x, kv_caches, meta)
        if cpu_layers is not None:
            x, residual = cpu_layers(x, rope.positions, rope.table.cos, rope.table.sin, kv_caches, meta.slot_mapping,
                                     meta.block_tables, meta.token_table, meta.context_lens)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(rope, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def _cpu_layers(self, rope: RotaryStep, x: torch.Tensor, kv_caches: torch.Tensor,
                    meta: AttentionMetadata) -> object | None:
        """csrc/decoder_layers.cpp's LlamaLayers (Gemma's: GemmaLayers) over the layers' one-call forms, where every
        layer has one (built by its first CPU-kernel step) and this step is one they run: the loop of ``forward`` in
        one call, the same bits. Kept with the forms it holds, and built again when a layer's form changes
        (``cpu_layer`` set anew)."""
        if not (rope.kernels is not None and type(meta) is CpuKernelMetadata and x.is_contiguous()
                and type(kv_caches) is torch.Tensor and len(kv_caches) == len(self.layers)):
            return None
        forms = tuple(layer.cpu_layer for layer in self.layers)
        if not all(forms):
            return None
        if self.cpu_layers is None or self.cpu_layers[0] != forms:
            self.cpu_layers = (forms, self._layers_in_one_call(rope.kernels, forms))
        return self.cpu_layers[1]

    def _layers_in_one_call(self, kernels, forms: tuple) -> object:
        return kernels.LlamaLayers(list(forms))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _merged_name(self, name: str) -> tuple[str, int | None, int | None]:
        """Where a checkpoint tensor goes: (parameter name, row offset, rows) in a fused q/k/v or gate/up
        matrix (or the fused q/k/v bias), or (name, None, None) for one loaded whole."""
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shards = {
            "q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in shards:
            merged, offset, size = shards[parts[-2]]
            if parts[-1] == "bias":
                return ".".join(parts[:-2] + [f"{merged}_bias"]), offset, size
            return ".".join(parts[:-2] + [merged, parts[-1]]), offset, size
        return name, None, None

    def _expert_slot(self, name: str) -> tuple[int, str, int, int]:
        """Where an expert's tensor (``layers.0.mlp.experts.5.up_proj.weight``) goes: (the expert's place among
        this model's experts, the layer's stacked parameter, row offset, rows)."""
        cfg = self.config
        prefix, _, rest = name.partition(".experts.")
        expert, kind, _ = rest.split(".")
        first, end = cfg.local_experts or (0, cfg.num_experts)
        if not first <= int(expert) < end:
            raise ValueError(f"unexpected weight {name!r}: this model holds experts {first} to {end - 1}")
        width = cfg.moe_intermediate_size
        stacked, offset, rows = {"gate_proj": ("gate_up_proj", 0, width), "up_proj": ("gate_up_proj", width, width),
                                 "down_proj": ("down_proj", 0, cfg.hidden_size)}[kind]
        return int(expert) - first, f"{prefix}.experts.{stacked}", offset, rows

    def use_block_weights(self, blocks: Iterable[tuple[str, BlockWeight]],
                          device: str | torch.device | None = None) -> set[str]:
        """Swaps each linear whose every shard ``blocks`` holds for a BlockQuantLinear on those blocks (on ``device``,
        default the linear's), shards in different block formats each in their own, and the embedding for a
        BlockEmbedding (a tied head takes the embedding's blocks too); returns the names of the checkpoint's tensors
        now read as blocks. A linear is built as soon as its last shard comes (a file's tensors come layer by layer),
        so that the blocks in their file layout are held for a layer at a time, not for the whole model."""
        cfg = self.config
        shards: dict[str, list[tuple[int, BlockWeight, str]]] = {}
        swapped: set[str] = set()
        for checkpoint_name, weight in blocks:
            name = checkpoint_name.removeprefix("model.")
            if name == "embed_tokens.weight":
                dense = self.embed_tokens.weight
                embedding = None
                if cfg.tie_word_embeddings and self._use_blocks("lm_head", [weight], device):
                    embedding = BlockEmbedding.of_head(self.lm_head, dense.dtype)  # one table for both
                if embedding is None:
                    embedding = BlockEmbedding.of_blocks(weight, dense.dtype,
                                                         dense.device if device is None else device)
                self.embed_tokens = embedding
                swapped.add(checkpoint_name)
                continue
            target, offset, _ = self._merged_name(name)
            module_name = target.removesuffix(".weight")
            parts = shards.setdefault(module_name, [])
            parts.append((offset or 0, weight, checkpoint_name))
            if len(parts) < (3 if module_name.endswith("qkv_proj") else 2 if module_name.endswith("gate_up_proj")
                             else 1):
                continue
            del shards[module_name]  # (one left incomplete, a tensor-parallel slice that cut blocks, stays dense)
            if self._use_blocks(module_name, [w for _, w, _ in sorted(parts, key=lambda p: p[0])], device):
                swapped.update(part_name for _, _, part_name in parts)
        return swapped

    def _use_blocks(self, module_name: str, parts: list[BlockWeight], device: str | torch.device | None) -> bool:
        """Whether the linear ``module_name`` now reads ``parts`` (its shards, in row order) as blocks."""
        module = self.get_submodule(module_name)
        if not isinstance(module, Linear):
            return False
        try:
            BlockWeight.runs(parts)
        except ValueError:  # shards of different widths: the layer stays dense
            return False
        if (sum(w.out_features for w in parts), parts[0].in_features) != (module.out_features, module.in_features):
            return False  # a shard is stored in another type
        layer = BlockQuantLinear(parts, module.weight.device if device is None else device)
        layer.float_output = module_name == "lm_head"
        self.set_submodule(module_name, layer)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...), fusing q/k/v and
        gate/up into their merged matrices."""
        self.tie_weights()  # moving between devices (meta → real) unties shared parameters
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if ".experts." in name:  # one expert's matrix in its layer's stack
                expert, name, offset, size = self._expert_slot(name)
            else:
                expert, (name, offset, size) = None, self._merged_name(name)
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            param = params[name].data if expert is None else params[name].data[expert]
            target = param if offset is None else param[offset: offset + size]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(":".join(str(part) for part in (name, expert, offset) if part is not None))
        experts = len(range(*(cfg.local_experts or (0, cfg.num_experts))))
        expected = sum(3 if ".qkv_proj" in n else 2 * experts if ".experts.gate_up_proj" in n
                       else experts if ".experts.down_proj" in n else 2 if ".gate_up_proj" in n else 1 for n in params
                       if not (n == "lm_head.weight" and cfg.tie_word_embeddings))
        if len(loaded) != expected:
            raise ValueError(f"checkpoint is missing weights: loaded {len(loaded)} of {expected} tensors")
