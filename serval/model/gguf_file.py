"""Reads a GGUF file of an architecture llama.cpp writes (llama, which Mistral and Mixtral are written as too; qwen2;
qwen3; qwen3moe; phi3; gemma2; gemma3): its header as a ModelConfig, its tensors dequantized under Hugging Face names.

Mixtures of experts: a layer with a router (``blk.N.ffn_gate_inp``) is a sparse layer; its experts are stored stacked,
``ffn_gate_exps``/``ffn_up_exps`` [experts, width, hidden] and ``ffn_down_exps`` [experts, hidden, width], and are
read as each expert's own matrices (dequantized: the block kernel reads 2-D matrices only)."""

from __future__ import annotations

import mmap
import re
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import torch

from serval.gguf_reader import GGUFContents, ggml_type
from serval.layers import cpu_kernels
from serval.layers.host_memory import empty_in_huge_pages
from serval.layers.linear import BlockWeight
from serval.model.config import ModelConfig

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
    # A mixture-of-experts layer's router and its stacked experts (split per expert in GGUFModelFile.weights).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
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
                     "qwen3moe": _QWEN3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES, "gemma2": _GEMMA3_LAYER_NAMES,
                     "gemma3": _GEMMA3_LAYER_NAMES}
# general.architecture values that load. llama.cpp's converter writes MistralForCausalLM as "llama" and keeps no
# sliding window (its LlamaModel has no such key; llama.cpp then attends to every key, and so does this loader).
ARCHITECTURES = tuple(_ARCH_LAYER_NAMES)
# Only for "llama" does the converter interleave each head's q/k rows (llama.cpp's RoPE there rotates adjacent
# pairs); the others run NEOX RoPE on rows stored as Hugging Face has them (rotate-half).
_ROPE_PERMUTED = ("llama",)
# GGUF block types that the block kernel reads as stored → its layout of them (BlockWeight.format).
BLOCK_FORMATS = {"Q4_0": "q4", "Q4_1": "q4", "Q5_0": "q5", "Q5_1": "q5", "Q8_0": "q8", "Q4_K": "q4k", "Q5_K": "q5k",
                 "Q6_K": "q6k"}
_SUPER_BLOCK = 256  # weights per K-quant block (Q4_K, Q5_K, Q6_K)
_K_QUANTS = {"Q4_K": "q4k", "Q5_K": "q5k", "Q6_K": "q6k"}
_EXTRA_BITS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # code bits above the nibbles
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


class GGUFModelFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFContents(self.path)
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: architecture {self.architecture!r} is not supported "
                             f"({', '.join(ARCHITECTURES)})")

    def field(self, key: str, default=None):
        return self.reader.value(key, default)

    def model_config(self) -> ModelConfig:
        arch = self.architecture
        hidden = int(self.field(f"{arch}.embedding_length"))
        heads = int(self.field(f"{arch}.attention.head_count"))
        names = {t.name for t in self.reader.tensors}
        vocab = self.field(f"{arch}.vocab_size") or self.reader.array_length("tokenizer.ggml.tokens")
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
        extra.update(self._experts(names, num_layers))
        family = extra.pop("architecture", arch)  # "mixtral" and "qwen3_moe", as the Hugging Face loader names them
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
            architecture=family,
            name=str(self.field("general.name", self.path.stem)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),  # per-head q/k RMSNorm
        )

    def _experts(self, names: set[str], num_layers: int) -> dict:
        """The mixture-of-experts fields of ModelConfig, none for a dense file. A layer with a router is sparse.
        Mixtral is written as "llama" with an expert count, its experts as wide as feed_forward_length; Qwen3-MoE as
        "qwen3moe" with expert_feed_forward_length. The top-k weights are renormalized unless the header's
        expert_weights_norm says otherwise: llama.cpp renormalizes both families' (Qwen3-MoE's released models set
        norm_topk_prob), and their converter writes no such key."""
        arch = self.architecture
        count = int(self.field(f"{arch}.expert_count", 0) or 0)
        layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
        if not count or not layers:
            return {}
        width = self.field(f"{arch}.expert_feed_forward_length") or self.field(f"{arch}.feed_forward_length")
        return dict(architecture="qwen3_moe" if arch == "qwen3moe" else "mixtral", num_experts=count,
                    num_experts_per_tok=int(self.field(f"{arch}.expert_used_count")),
                    moe_intermediate_size=int(width),
                    norm_topk_prob=bool(self.field(f"{arch}.expert_weights_norm", True)), moe_layers=layers)

    def _vector(self, name: str) -> list[float] | None:
        """The values of the 1-D tensor ``name`` (RoPE factors), or None where the file has none."""
        tensor = next((t for t in self.reader.tensors if t.name == name), None)
        if tensor is None:
            return None
        return np.array(_dequantized(tensor), dtype=np.float64).reshape(-1).tolist()

    def weights(self, config: ModelConfig, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) pairs, one dequantized at a time, but those named in ``skip`` (read
        as blocks). q/k rows of "llama" files are put back from llama.cpp's RoPE order."""
        for tensor in self.reader.tensors:
            qtype = ggml_type(tensor.tensor_type)[0]
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path.name}: tensor {tensor.name} has unsupported type {qtype}")
            name = _hf_name(tensor.name, self.architecture)
            if name is None or name in skip:
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape))
            array = np.array(_dequantized(tensor), dtype=np.float32).reshape(shape)
            _drop_pages(tensor.data)
            weight = torch.from_numpy(array)
            if ".experts." in name:  # stacked [experts, rows, columns]: each expert's matrix under its own name
                prefix, _, kind = name.removesuffix(".weight").rpartition(".experts.")
                for i, expert in enumerate(weight):
                    yield f"{prefix}.experts.{i}.{kind}.weight", expert
                continue
            if self.architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # stored as 1 + w
                weight = weight - 1
            elif self.architecture in _ROPE_PERMUTED and name.endswith("q_proj.weight"):
                weight = _unpermute_rope(weight, config.num_heads)
            elif self.architecture in _ROPE_PERMUTED and name.endswith("k_proj.weight"):
                weight = _unpermute_rope(weight, config.num_kv_heads)
            yield name, weight


    def block_weights(self, config: ModelConfig) -> Iterator[tuple[str, BlockWeight]]:
        """(Hugging Face name, BlockWeight) of every matrix stored in a type of BLOCK_FORMATS: its blocks as stored,
        repacked without loss for the block kernel (rows put back from llama.cpp's RoPE order like weights())."""
        for tensor in self.reader.tensors:
            qtype = ggml_type(tensor.tensor_type)[0]
            name = _hf_name(tensor.name, self.architecture)
            # (A router stays dense, in the model's dtype: it is small, and its top-k choice is sensitive.)
            if (name is None or qtype not in BLOCK_FORMATS or len(tensor.shape) != 2
                    or name.endswith("mlp.gate.weight")):
                continue
            in_features, out_features = (int(d) for d in tensor.shape)
            heads = None
            if self.architecture in _ROPE_PERMUTED and name.endswith("q_proj.weight"):
                heads = config.num_heads
            elif self.architecture in _ROPE_PERMUTED and name.endswith("k_proj.weight"):
                heads = config.num_kv_heads
            if qtype in _K_QUANTS and cpu_kernels.for_device(torch.device("cpu")) is not None:
                # read from the map by the kernel when the weight's panels are made, in one pass
                order = None if heads is None else _unpermute_rope(torch.arange(out_features)[:, None], heads)[:, 0]
                yield name, FileKBlocks(qtype, tensor.data, in_features, order)
                continue
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # the blocks' views of these bytes are kept
            block = _SUPER_BLOCK if qtype.endswith("_K") else 32
            weight = _to_block_weight(qtype, raw.reshape(out_features, in_features // block, -1), in_features)
            _drop_pages(tensor.data)
            yield name, weight if heads is None else _unpermute_blocks(weight, heads)


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor's values: a plain one's as they are, a quantized one's by the gguf package's dequantize
    (imported only here: 0.1 s of a start that reads none)."""
    if tensor.data.dtype in (np.float32, np.float16):
        return tensor.data
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))


class FileKBlocks(BlockWeight):
    """A K-quant matrix (Q4_K, Q5_K, Q6_K) still in the file's super-blocks, rows ``order`` of them (a RoPE
    un-permute) or all in turn. Its panels are written straight from the file's map in one pass
    (csrc/block_repack.cpp's gguf_k_panels_; the bytes of gguf_k_blocks then block_panels_,
    tests/layers/test_block_repack.py), the file's pages given back after; anything else that reads its blocks
    (a tensor-parallel slice, a fused matrix cut apart) gets them made once, as _to_block_weight makes them. Made
    only where the CPU kernels are built."""

    def __init__(self, qtype: str, view: np.ndarray, in_features: int, order: torch.Tensor | None = None) -> None:
        rows = int(view.shape[0])
        self.format = _K_QUANTS[qtype]
        self.in_features = in_features
        self.known_codes = None
        self._qtype = qtype
        self._view = view  # bytes of the file's map, [rows, row bytes]
        self._raw = _file_bytes(view).reshape(rows, in_features // _SUPER_BLOCK, -1)
        self._order = order
        self._blocks: BlockWeight | None = None

    @property
    def out_features(self) -> int:
        return self._raw.shape[0] if self._order is None else self._order.shape[0]

    @property
    def block_shape(self) -> tuple[int, int]:
        return self._raw.shape[1] * (_SUPER_BLOCK // 32), 16 + 4 * _EXTRA_BITS[self._qtype]

    def _made(self) -> BlockWeight:
        if self._blocks is None:
            weight = _to_block_weight(self._qtype, self._raw, self.in_features)
            if self._order is not None:
                weight = BlockWeight(weight.format, weight.packed[self._order], weight.scales[self._order],
                                     weight.in_features, weight.super_scales[self._order])
            self._blocks = weight
            _drop_pages(self._view)
        return self._blocks

    packed = property(lambda self: self._made().packed)
    scales = property(lambda self: self._made().scales)
    super_scales = property(lambda self: self._made().super_scales)

    def panels(self, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._blocks is not None:
            return self._blocks.panels(into)
        q, scales = self._empty_panels(-(-self.out_features // 32) * 2) if into is None else into
        cpu_kernels.for_device(self._raw.device).gguf_k_panels_(self._raw, self._qtype, self._order, q, scales)
        _drop_pages(self._view)
        return q, scales

    def _empty_panels(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        groups, block_bytes = self.block_shape
        halves = 1 if self._qtype == "Q6_K" else 2  # float16 rows a super-block: d (and -dmin)
        return (empty_in_huge_pages((count, groups, block_bytes, 16), torch.uint8),
                empty_in_huge_pages((count, self._raw.shape[1], halves * 32 + 256), torch.uint8))


def _file_bytes(view: np.ndarray) -> torch.Tensor:
    """A tensor over ``view``, bytes of the read-only memory map, to be read only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(view)


def _drop_pages(view: np.ndarray) -> None:
    """Gives back the file's pages under ``view`` (a tensor of the GGUFContents memory map, read and copied): a map's
    pages, once touched, count in the process's memory until unmapped, which would hold the whole file beside its
    loaded copy while loading. The pages stay in the OS's file cache; touching them again reads them back."""
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root.base, mmap.mmap):  # not a view of a map
        return
    start = view.ctypes.data - root.ctypes.data
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    end = start + view.nbytes
    if end > first:
        root.base.madvise(mmap.MADV_DONTNEED, first, end - first)


def _to_block_weight(qtype: str, raw: torch.Tensor, in_features: int) -> BlockWeight:
    """raw [N, blocks, bytes]: GGUF blocks (32 weights, or 256 for the K-quants) as the block kernel's layout of
    blocks of 32 (BLOCK_FORMATS), without loss."""
    if qtype == "Q4_1":  # d, m, 16 bytes of nibbles: already the kernel's layout
        weight = BlockWeight("q4", raw[..., 4:], _copy(raw[..., :4]).view(torch.int16), in_features)
    elif qtype == "Q4_0":  # d, nibbles; w = d (q - 8) = d q + m with m = -8 d (exact in float16)
        d = _copy(raw[..., :2]).view(torch.float16)
        scales = torch.cat([d, d * -8], dim=-1).view(torch.int16)
        weight = BlockWeight("q4", raw[..., 2:], scales, in_features)
    elif qtype == "Q8_0":  # d, 32 signed bytes
        weight = BlockWeight("q8", raw[..., 2:], _copy(raw[..., :2]).view(torch.int16), in_features)
    elif qtype == "Q5_1":  # d, m, the fifth bits (little-endian 32 bits), nibbles
        weight = BlockWeight("q5", torch.cat([raw[..., 8:], raw[..., 4:8]], dim=-1),
                             _copy(raw[..., :4]).view(torch.int16), in_features)
    elif qtype == "Q5_0":  # d, fifth bits, nibbles; w = d (q - 16) = d q + m with m = -16 d
        d = _copy(raw[..., :2]).view(torch.float16)
        scales = torch.cat([d.float(), d.float() * -16], dim=-1)
        packed = torch.cat([raw[..., 6:], raw[..., 2:6]], dim=-1)
        if torch.isfinite(scales.half()).all():  # -16 d is exact in float16 unless it overflows
            weight = BlockWeight("q5", packed, scales.half().view(torch.int16), in_features)
        else:
            weight = BlockWeight("q5f", packed, scales.view(torch.int32), in_features)
    elif qtype in _K_QUANTS and (kernels := cpu_kernels.for_device(raw.device)) is not None:
        packed, scales, super_scales = kernels.gguf_k_blocks(raw.contiguous(), qtype)  # one pass (block_repack.cpp)
        weight = BlockWeight(_K_QUANTS[qtype], packed, scales, in_features, super_scales)
    else:
        weight = _k_block_weight_by_torch(qtype, raw, in_features)
    return weight  # (views of ``raw`` where they can be: the kernel's panels are the one copy made of them)


def _k_block_weight_by_torch(qtype: str, raw: torch.Tensor, in_features: int) -> BlockWeight:
    """``_to_block_weight`` of K-quant blocks by PyTorch ops: where the CPU kernels are not built, and the reference
    they are tested against (tests/layers/test_block_repack.py)."""
    n = raw.shape[0]
    if qtype in ("Q4_K", "Q5_K"):
        # d, dmin (float16), 12 bytes of 6-bit sub-block scales and mins, [Q5_K: 32 bytes of fifth bits,] 128 bytes
        # of nibbles: byte l of each 32 holds weight l of sub-block 2j (low nibble) and of 2j + 1 (high).
        d, dmin = (raw[..., i: i + 2].contiguous().view(torch.float16) for i in (0, 2))
        sc, mn = _k_scale_min(raw[..., 4:16])
        scales = torch.stack([sc, mn], dim=-1)  # [N, blocks, 8, 2] uint8
        qs = raw[..., -128:].unflatten(-1, (4, 1, 32))  # bytes 32 j + i: weight i of sub-blocks 2 j, 2 j + 1
        codes = torch.cat([qs & 15, qs >> 4], dim=-2).flatten(-3)  # weight 32 s + i, s = 2 j + nibble
        if qtype == "Q5_K":  # weight i of sub-block s: bit s of byte i
            bits = torch.arange(8, dtype=torch.uint8)[:, None]
            codes |= ((raw[..., None, 16:48] >> bits) & 1).flatten(-2) << 4
        fmt = "q4k" if qtype == "Q4_K" else "q5k"
        weight = BlockWeight.from_codes(fmt, codes.view(n, -1, 32), scales.view(n, -1, 2), in_features,
                                        torch.cat([d, -dmin], dim=-1))  # -dmin: exact in float16
    elif qtype == "Q6_K":
        # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights), float16 d. Weight
        # 128 h + 32 quarter + i: nibble of byte 64 h + 32 (quarter % 2) + i (high nibble for quarters 2-3),
        # bits 2 quarter of byte 128 + 32 h + i.
        ql = raw[..., :128].unflatten(-1, (2, 2, 32))  # [h, quarter % 2, i]
        low = torch.cat([ql & 15, ql >> 4], dim=-2)  # [h, quarter, i]
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]
        high = (raw[..., 128:192].unflatten(-1, (2, 1, 32)) >> shifts) & 3  # [h, quarter, i]
        d = raw[..., 208:210].contiguous().view(torch.float16)
        scales = raw[..., 192:208].contiguous().view(torch.int8)  # [N, blocks, 16]
        weight = BlockWeight.from_codes("q6k", (low | (high << 4)).reshape(n, -1, 32), scales.view(n, -1, 2),
                                        in_features, d)
    else:
        raise ValueError(f"{qtype} has no block kernel layout")
    return weight


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor (a slice of each block's bytes): numpy's copy of such strided bytes takes
    0.3 ms a matrix where torch's takes 10-15 (measured on SmolLM2's [1536, 18, 20] blocks)."""
    return torch.from_numpy(np.ascontiguousarray(tensor.numpy()))


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes per block → the 8 sub-blocks' 6-bit scales and mins (uint8): the first 4 in
    the low 6 bits of bytes 0-3 and 4-7, the last 4 in the nibbles of bytes 8-11 with their top 2 bits in the top
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, last = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([first & 63, (last & 15) | ((first >> 6) << 4)], dim=-1)
    mn = torch.cat([second & 63, (last >> 4) | ((second >> 6) << 4)], dim=-1)
    return sc, mn


def _unpermute_blocks(weight: BlockWeight, num_heads: int) -> BlockWeight:
    supers = None if weight.super_scales is None else _unpermute_rope(weight.super_scales, num_heads)
    return BlockWeight(weight.format, _unpermute_rope(weight.packed, num_heads),
                       _unpermute_rope(weight.scales, num_heads), weight.in_features, supers)


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
    halves = weight.numpy().reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2)
    return torch.from_numpy(np.ascontiguousarray(halves)).reshape(weight.shape)  # numpy: see _copy
