"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama), with Llama-3, linear and LongRoPE
(Phi-3) scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from serval.layers import cpu_kernels, triton_ops


def _inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv_freq
    if kind == "divisors":  # per-frequency, as llama.cpp's rope_freqs tensor gives them
        return inv_freq / torch.tensor(scaling["divisors"], dtype=torch.float64)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _angles(head_dim: int, max_position: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """[max_position, head_dim / 2] float64 rotation angle of each position and frequency, and the factor on cos and
    sin (1 but for LongRoPE)."""
    positions = torch.arange(max_position, dtype=torch.float64)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind != "longrope":
        return torch.outer(positions, _inverse_frequencies(head_dim, theta, scaling)), 1.0
    # LongRoPE, as transformers computes it: each frequency divided by its factor, the short factors inside the
    # original context and the long ones past it; cos and sin scaled by the attention factor. transformers picks one
    # set for a whole forward by its last position (a prompt past the original context rotates all its tokens with
    # the long factors); here each position has its own, so a token's rotation never depends on the tokens beside it
    # (batches, chunks and cached prefixes agree). The two agree wherever a prompt fits the original context, as do
    # transformers' generate and ours after it (each new token by its position).
    original = scaling["original_max_position_embeddings"]
    inv_freq = _inverse_frequencies(head_dim, theta, None)
    short = torch.outer(positions, inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64))
    long = torch.outer(positions, inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float64))
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return torch.where(positions[:, None] < original, short, long), attention_factor


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys of a flat token batch, by absolute position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.args = (head_dim, max_position, theta, scaling)  # to build the tables again (after a meta device)
        if torch.get_default_device().type == "meta":  # shapes only: computing on meta imports torch._refs (0.9 s)
            self.register_buffer("cos", torch.empty(max_position, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_position, head_dim), persistent=False)
            return
        angles, scale = _angles(head_dim, max_position, theta, scaling)
        angles = angles.float()  # both halves of a row rotate by the same angles: cos and sin of one half, twice
        self.register_buffer("cos", (angles.cos() * scale).repeat(1, 2), persistent=False)
        self.register_buffer("sin", (angles.sin() * scale).repeat(1, 2), persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """The step's rotation, shared by every layer. The CPU kernel reads the tables by position; the PyTorch
        path gathers two [T, 1, D] tensors in ``dtype`` once here. On CUDA a Triton kernel reads them by position."""
        if (kernels := cpu_kernels.for_device(positions.device)) is not None:
            return RotaryStep(positions, self, kernels=kernels)
        if (fused := triton_ops.for_tensor(positions)) is not None:
            return RotaryStep(positions, self, fused=fused)
        return RotaryStep(positions, self, self.cos[positions].unsqueeze(1).to(dtype),
                          self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates [T, heads, D] (queries and keys together, in one call)."""
        return x * cos + _rotate_half(x) * sin


@dataclass
class RotaryStep:
    positions: torch.Tensor  # [T]
    table: RotaryEmbedding
    cos: torch.Tensor | None = None  # [T, 1, D] in the model dtype, for the PyTorch path
    sin: torch.Tensor | None = None
    kernels: ModuleType | None = None  # the CPU kernels, which read the tables by position (then no cos and sin)
    fused: ModuleType | None = None  # the Triton kernels on CUDA, which read them by position too

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, heads, D] in place (each token's heads contiguous) and returns it."""
        if self.kernels is not None:
            self.kernels.rotary_embedding_(x, self.positions, self.table.cos, self.table.sin)
            return x
        if self.fused is not None:
            return self.fused.rotary_(x, self.positions, self.table.cos, self.table.sin)
        return x.copy_(RotaryEmbedding.apply(x, self.cos, self.sin))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
