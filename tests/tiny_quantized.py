"""Tiny GPTQ and AWQ checkpoints packed here from known integer weights, written from the formats as AutoGPTQ and
AutoAWQ document and pack them (not from Serval's code), with their dequantized weights in float64."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

# AutoAWQ packs output columns 8c..8c+7 of a word in this order: nibble j holds column 8c + AWQ_PACK_ORDER[j].
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# Linears that read the same input as another: the one whose order they share.
_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj")


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "gptq" or "awq"
    group_size: int
    sym: bool = False  # GPTQ: every zero 8 (stored 7)
    desc_act: bool = False  # GPTQ: inputs assigned to groups in a shuffled order (g_idx not i // group_size)
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" stores zero - 1, "gptq_v2" the zero

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm"}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "sym": self.sym,
                "desc_act": self.desc_act, "checkpoint_format": self.checkpoint_format}


def _pack(values: np.ndarray, axis: int) -> torch.Tensor:
    """int32 words of 8 nibbles along ``axis`` (0 or 1): value k of a run of 8 in bits 4k..4k+3."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = (v << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32))


def pack_linear(spec: QuantSpec, out_features: int, in_features: int, rng: np.random.Generator,
                shuffle: np.ndarray | None = None) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Random 4-bit weights of one linear [out, in]: (its checkpoint tensors by part name, w float64 [out, in]).
    With desc_act, inputs go to groups in the order ``shuffle`` (a permutation; random if not given)."""
    groups = in_features // spec.group_size
    q = rng.integers(0, 16, size=(in_features, out_features))  # [in, out], as both formats store it
    # Scales that give weights of std ~1/sqrt(in) (|q - zero| is ~4.6 on average).
    scales = (rng.uniform(0.5, 1.5, size=(groups, out_features)) / (4.6 * in_features ** 0.5)).astype(np.float16)
    s = scales.astype(np.float64)
    if spec.method == "awq":
        zeros = rng.integers(0, 16, size=(groups, out_features))
        g = np.arange(in_features) // spec.group_size
        w = s[g] * (q - zeros[g])  # [in, out]
        columns = (np.arange(0, out_features, 8)[:, None] + np.array(AWQ_PACK_ORDER)).reshape(-1)
        tensors = {"qweight": _pack(q[:, columns], 1), "qzeros": _pack(zeros[:, columns], 1)}
    else:
        stored = np.full((groups, out_features), 7) if spec.sym else rng.integers(0, 16, size=(groups, out_features))
        zeros = stored + (1 if spec.checkpoint_format == "gptq" else 0)  # v1's "zero + 1"
        g = np.arange(in_features) // spec.group_size
        if spec.desc_act:
            g = g[rng.permutation(in_features) if shuffle is None else shuffle]
        w = s[g] * (q - zeros[g])
        tensors = {"qweight": _pack(q, 0), "qzeros": _pack(stored, 1),
                   "g_idx": torch.from_numpy(g.astype(np.int32))}
    tensors["scales"] = torch.from_numpy(scales)
    return tensors, w.T.copy()


def save_quantized_dir(directory: Path, hf: torch.nn.Module, spec: QuantSpec, seed: int = 0) -> torch.nn.Module:
    """Writes ``hf`` (a transformers model, already saved in ``directory`` with save_pretrained) again with every
    layer's linear quantized as ``spec`` says, and sets ``hf``'s weights to their exact dequantized values (the
    dense reference); returns ``hf``."""
    rng = np.random.default_rng(seed)
    tensors = {}
    # desc_act: linears that read the same input (q/k/v, gate/up) share its group order, as GPTQ gives them.
    shuffles: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            prefix, _, leaf = name.rpartition(".")
            block, _, linear = prefix.rpartition(".")
            if leaf == "weight" and linear in QUANTIZED_LINEARS:
                reads = f"{block}.{_SAME_INPUT.get(linear, linear)}"
                shuffle = shuffles.setdefault(reads, rng.permutation(param.shape[1]))
                parts, w = pack_linear(spec, *param.shape, rng, shuffle)
                tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
                param.copy_(torch.from_numpy(w))  # exact: float32 holds an fp16 scale times a small integer
            else:
                tensors[name] = param.detach().clone().contiguous()
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = spec.quantization_config()
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return hf
