"""GPTQ and AWQ 4-bit checkpoints: Hugging Face safetensors directories whose config.json has a
``quantization_config``, each quantized linear [out, in] stored as qweight / qzeros / scales (and GPTQ's g_idx).

Inputs fall in groups of ``group_size`` (-1: one group over the whole input); per group and output column, one
float16 scale and one 4-bit zero. As AutoGPTQ, AutoAWQ and vLLM's gptq/awq layers pack and read them:

| method | qweight                                   | qzeros / scales                 | w[o, i]                      |
|--------|-------------------------------------------|---------------------------------|------------------------------|
| gptq   | int32 [in/8, out]: input 8r+j in nibble j | [groups, out/8] / [groups, out] | s[g, o] * (q - (z[g, o] + 1))|
|        | of row r                                  | (output 8c+j in nibble j)       | g = g_idx[i]                 |
| awq    | int32 [in, out/8]: output 8c + k in       | same packing as qweight /       | s[g, o] * (q - z[g, o])      |
|        | nibble (0, 4, 1, 5, 2, 6, 3, 7)[k]        | [groups, out]                   | g = i // group_size          |

GPTQ's "+ 1" is the convention of v1 checkpoints (``checkpoint_format`` "gptq", the default: zeros stored minus
one); "gptq_v2" stores the zeros themselves.

Loaded two ways: dequantized exactly (float32 holds s * (q - z) without rounding) for the dense PyTorch path, and as
the CPU kernel's 4-bit blocks (layers/linear.py BlockWeight "q4": 32 inputs per block, w = d * q + m, d and m
float16): a group of 128 is four blocks with the same d = s and m = -s * z. That m rounds to float16: exact when z
is a power of two (symmetric GPTQ: z = 8), else off by at most half a float16 ulp of s * z, under 2^-11 * 15 s, less
than 1/128 of a quantization step (tests/model/test_gptq_awq.py measures it).

GPTQ's desc_act ("act order") assigns inputs to groups out of order (g_idx is not i // group_size): its inputs are
sorted by group, so each group is a run of whole blocks, and the layer takes its activations in that order
(InputPermuted: one index_select per call). Fused q/k/v or gate/up parts must share one order (GPTQ quantizes them on
the same inputs, so they do), and tensor parallelism keeps such a linear dense (a rank's input columns would not be
a run of the permuted ones); so does a group size that is not a multiple of 32.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serval.layers.linear import BLOCK_SIZE, BlockQuantLinear, BlockWeight
from serval.model.config import ModelConfig
from serval.model.llama import LlamaForCausalLM, split_fused_weights
from serval.model.parallel import TensorParallelShard

METHODS = ("gptq", "awq")
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# AWQ's nibble j holds output column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j], so output 8c + k sits in nibble _AWQ_NIBBLE[k].
_AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]


@dataclass(frozen=True)
class WeightQuantization:
    """A checkpoint's ``quantization_config``, validated."""

    method: str  # "gptq" or "awq"
    group_size: int  # inputs per group; -1: one group over the whole input
    zero_offset: int  # added to the stored zeros: 1 for GPTQ v1 checkpoints, else 0

    def is_part(self, name: str) -> bool:
        """Whether a checkpoint tensor is a piece of a quantized linear."""
        return name.rpartition(".")[2] in _PARTS

    def dequantized_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with every quantized linear as its float32 ``<linear>.weight`` [out, in]."""
        for name, item in self._linears(weights):
            yield name, item.dequantize() if isinstance(item, QuantizedLinear) else item

    def block_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, BlockWeight, torch.Tensor | None]]:
        """(``<linear>.weight``, its BlockWeight, the input order the blocks are in: None for the weight's own) of
        every quantized linear whose groups make whole blocks of 32."""
        for name, item in self._linears(weights):
            if isinstance(item, QuantizedLinear) and (blocks := item.block_weight()) is not None:
                yield name, *blocks

    def _linears(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedLinear]]:
        """Other tensors as they come; each quantized linear once all its parts have come (a linear's parts may sit
        in different files; g_idx, which older GPTQ files lack, is waited for until the end)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.method == "gptq" else set())
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if leaf not in _PARTS:
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[leaf] = tensor
            if needed <= parts.keys():
                yield f"{prefix}.weight", self._unpack(prefix, pending.pop(prefix))
        for prefix, parts in pending.items():
            missing = {"qweight", "qzeros", "scales"} - parts.keys()
            if missing:
                raise ValueError(f"quantized linear {prefix!r} lacks {', '.join(sorted(missing))}")
            yield f"{prefix}.weight", self._unpack(prefix, parts)

    def _unpack(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedLinear:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        if self.method == "gptq":  # [in/8, out]: inputs along the packed dimension
            q = _nibbles(qweight.t())
            zeros = _nibbles(qzeros)
        else:  # [in, out/8]: outputs along it, interleaved
            q = _awq_order(_nibbles(qweight)).t()
            zeros = _awq_order(_nibbles(qzeros))
        out_features, in_features = q.shape
        if scales.shape[1] != out_features or zeros.shape != scales.shape:
            raise ValueError(f"quantized linear {prefix!r}: qweight {tuple(qweight.shape)}, qzeros "
                             f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not fit together")
        group_size = in_features if self.group_size == -1 else self.group_size
        groups = torch.arange(in_features) // group_size
        if "g_idx" in parts:
            groups = parts["g_idx"].long()
        if groups.shape != (in_features,) or int(groups.max()) >= scales.shape[0]:
            raise ValueError(f"quantized linear {prefix!r}: g_idx does not fit its {scales.shape[0]} groups")
        return QuantizedLinear(q.contiguous(), scales.float(), zeros.to(torch.int16) + self.zero_offset, groups,
                               group_size)


@dataclass
class QuantizedLinear:
    """One linear's 4-bit weights, unpacked: w[o, i] = scales[g, o] * (q[o, i] - zeros[g, o]), g = groups[i]."""

    q: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # float32 [groups, out], as stored (float16 in both formats' checkpoints)
    zeros: torch.Tensor  # int16 [groups, out], the stored zeros plus the format's offset
    groups: torch.Tensor  # int64 [in]: each input's group
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], exact for float16 (or bfloat16) scales: an 11-bit significand times an integer of at
        most 5 bits."""
        scales = self.scales[self.groups].t()
        zeros = self.zeros.float()[self.groups].t()
        return scales * (self.q.float() - zeros)

    def block_weight(self) -> tuple[BlockWeight, torch.Tensor | None] | None:
        """The kernel's "q4" blocks (d = scale, m = -scale * zero rounded to float16), and the order of the inputs
        they hold: None for the weight's own, else a permutation (GPTQ's desc_act: inputs sorted by group, so each
        group is a run of whole blocks; the activations must be taken in that order). None where groups cannot
        make whole blocks of 32."""
        out_features, in_features = self.q.shape
        contiguous = torch.arange(in_features) // self.group_size
        order = None
        if not torch.equal(self.groups, contiguous):
            order = torch.argsort(self.groups, stable=True)
            if not torch.equal(self.groups[order], contiguous):  # groups of other sizes: no run of whole blocks
                return None
        if self.group_size % BLOCK_SIZE or in_features % BLOCK_SIZE:
            return None
        q = self.q if order is None else self.q[:, order]
        q = q.reshape(out_features, in_features // BLOCK_SIZE, BLOCK_SIZE)
        packed = q[..., :16] | (q[..., 16:] << 4)  # byte i: weight i (low nibble) and i + 16 (high)
        block_group = contiguous[::BLOCK_SIZE]
        d = self.scales[block_group].t().to(torch.float16)
        m = (-(self.scales * self.zeros.float()))[block_group].t().to(torch.float16)  # exact product, rounded once
        scales = torch.stack([d, m], dim=-1).contiguous().view(torch.int16)
        return BlockWeight("q4", packed.contiguous(), scales, in_features), order


class InputPermuted(nn.Module):
    """A linear whose weight columns are stored in another order than its inputs (GPTQ's desc_act read as blocks):
    y = linear(x[..., order])."""

    def __init__(self, linear: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("order", order.to(device=next(linear.buffers()).device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.order))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] → uint8 [R, 8 C]: nibble j (bits 4j..4j+3) of word c at column 8c + j."""
    values = (packed.to(torch.int32)[:, :, None] >> _SHIFTS) & 15
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def _awq_order(nibbles: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved columns put back in output order."""
    rows, columns = nibbles.shape
    index = (torch.arange(0, columns, 8)[:, None] + torch.tensor(_AWQ_NIBBLE)).reshape(-1)
    return nibbles[:, index]


def read_weight_quantization(path: Path) -> WeightQuantization | None:
    """The directory's ``quantization_config`` (None without one); a ValueError names a field it cannot load."""
    config = path / "config.json"
    if path.suffix == ".gguf" or not config.is_file():
        return None
    raw = json.loads(config.read_text()).get("quantization_config")
    if raw is None:
        return None

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{path.name}: quantization_config.{field} = {raw.get(field)!r} is not supported ({why})")

    method = raw.get("quant_method")
    if method not in METHODS:
        raise refuse("quant_method", "gptq and awq 4-bit checkpoints load")
    if raw.get("bits") != 4:
        raise refuse("bits", "4-bit weights only")
    group_size = raw.get("group_size", 128)
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise refuse("group_size", "a positive size, or -1 for one group a row")
    if method == "awq":
        if str(raw.get("version", "gemm")).lower() != "gemm":
            raise refuse("version", "AWQ's gemm packing only")
        if raw.get("zero_point", True) is not True:
            raise refuse("zero_point", "AWQ with zero points only")
        return WeightQuantization("awq", group_size, 0)
    if raw.get("is_marlin_format"):
        raise refuse("is_marlin_format", "GPTQ's own packing only")
    checkpoint_format = raw.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", "gptq or gptq_v2")
    return WeightQuantization("gptq", group_size, 1 if checkpoint_format == "gptq" else 0)


def use_checkpoint_blocks(model: LlamaForCausalLM, blocks: Iterable[tuple[str, BlockWeight, torch.Tensor | None]],
                          config: ModelConfig, shard: TensorParallelShard | None = None) -> int:
    """Swaps each of ``model``'s linears whose parts ``blocks`` (WeightQuantization.block_weights) holds for a
    BlockQuantLinear (a tensor-parallel rank's slices with a ``shard``); returns how many. A linear stored in another
    input order takes its inputs in that order (InputPermuted), when all its fused parts share it and the linear is
    whole (no tensor parallelism: a rank's columns would not be a run of the permuted ones); else it stays dense."""
    parts: list[tuple[str, str, BlockWeight]] = []  # (model module, checkpoint name, blocks)
    orders: dict[str, list[torch.Tensor | None]] = {}
    for name, weight, order in blocks:
        for part, piece in split_fused_weights([(name, weight)], config):
            module = model._merged_name(part.removeprefix("model."))[0].removesuffix(".weight")
            parts.append((module, part, piece))
            orders.setdefault(module, []).append(order)
    usable = {}
    for module, found in orders.items():
        first = found[0]
        if all(o is None for o in found) or (first is not None and shard is None and
                                             all(o is not None and torch.equal(o, first) for o in found)):
            usable[module] = first
    chosen = [(part, piece) for module, part, piece in parts if module in usable]
    model.use_block_weights(chosen if shard is None else shard.shard_weights(chosen))
    swapped = 0
    for module, order in usable.items():
        layer = model.get_submodule(module)
        if not isinstance(layer, BlockQuantLinear):
            continue
        swapped += 1
        if order is not None:
            model.set_submodule(module, InputPermuted(layer, order))
    return swapped
