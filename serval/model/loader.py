"""Builds a model on a device and dtype from a GGUF file or a Hugging Face directory (safetensors + config.json)."""

from __future__ import annotations

import ctypes
import json
import logging
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from serval.config import EngineConfig
from serval.distributed import ParallelGroup
from serval.gguf_reader import ggml_type
from serval.layers import cpu_kernels
from serval.layers.fp8_linear import check_fp8_device, quantize_linears_to_fp8
from serval.layers.linear import (
    lay_out_for_cpu_kernels,
    probe_row_padding,
    quantize_linears,
    use_activation_quantization,
    use_dot_products,
)
from serval.model.config import ModelConfig
from serval.model.gemma3 import Gemma3ForCausalLM
from serval.model.gguf_file import BLOCK_FORMATS, GGUFModelFile
from serval.model.gptq_awq import METHODS as CHECKPOINT_METHODS
from serval.model.gptq_awq import read_weight_quantization, use_checkpoint_blocks
from serval.model.hf_config import read_hf_config
from serval.model.llama import LlamaForCausalLM, split_fused_weights, use_cpu_layers
from serval.model.parallel import PipelineStage, TensorParallelShard

logger = logging.getLogger(__name__)

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


try:  # glibc's malloc_trim (not on musl or macOS: nothing to trim there)
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _malloc_trim = None
try:  # glibc 2.33+: the heap's free bytes
    _mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    _mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):
    _mallinfo2 = None
# Free heap a load keeps for its next tensors before it gives it back (_trim_heap).
_KEPT_FREE_HEAP = 256 << 20

# ModelConfig.architecture (a GGUF file's, or the family model/hf_config.py reads) → its model definition.
_MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                  "qwen3": LlamaForCausalLM, "phi3": LlamaForCausalLM, "gemma2": Gemma3ForCausalLM,
                  "gemma3": Gemma3ForCausalLM, "mixtral": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM}


def build_model(path: Path, config: EngineConfig, group: ParallelGroup | None = None, quantization: str | None = None,
                expert_parallel: bool | None = None, loaded: torch.nn.Module | None = None) -> torch.nn.Module:
    """The one recipe for a model the engine runs (the target, a draft, every model-parallel rank's shard): loaded
    as ``config`` (settled) says, ``quantization`` and ``expert_parallel`` where they differ from it (a draft), on
    ``group``'s device when given (or ``loaded`` already, by the caller), then prepared for the runner: the CPU
    block kernel's activation quantization and dot products, and the one-call CPU layers. The activation quantization
    and dot products chosen ("auto" measured; what KV blocks computed by the model depend on) are its
    ``activation_quantization`` and ``dot_products``."""
    model = loaded if loaded is not None else load_model(
        path, config.torch_dtype, group.device if group is not None else config.device,
        config.quantization if quantization is None else quantization, group,
        config.enable_expert_parallel if expert_parallel is None else expert_parallel,
        config.load_format if quantization is None else "auto")  # (a draft's weights are its file's)
    model.activation_quantization = use_activation_quantization(model, config.activation_quantization)
    model.dot_products = use_dot_products(model, config.block_dot_products)
    use_cpu_layers(model, not config.enforce_eager)
    return model


def load_model(path: Path, dtype: torch.dtype, device: str | torch.device = "cpu", quantization: str = "auto",
               group: ParallelGroup | None = None, expert_parallel: bool = False,
               load_format: str = "auto") -> LlamaForCausalLM | Gemma3ForCausalLM | PipelineStage:
    """The model in ``dtype`` on ``device``; ``quantization`` as EngineConfig.quantization describes. With a
    ``group`` of several ranks: this rank's tensor-parallel shard of its pipeline stage (model/parallel.py), wrapped
    in a PipelineStage when there are several stages; ``expert_parallel`` (EngineConfig.enable_expert_parallel):
    the shard holds whole experts, not a slice of each. ``load_format`` "dummy": random weights
    (EngineConfig.load_format).

    Each tensor goes from the file to its final form, one at a time: a GGUF's blocks into the block kernel's
    layout (never dequantized), other tensors into parameters made in ``dtype`` on ``device`` (a float32 copy of
    one tensor at a time at most). So the process holds about the file's size, not 4 bytes a parameter."""
    start = time.perf_counter()
    parallel = group is not None and group.tensor_size > 1
    dummy = load_format == "dummy"
    gguf = checkpoint = None
    if path.suffix == ".gguf":
        gguf = GGUFModelFile(path)  # its header read once (0.04-0.06 s at a 128k vocabulary)
    quantization = resolve_quantization(path, device, dtype, quantization, dummy, gguf)
    if gguf is not None:
        config = gguf.model_config()
    else:
        config = read_hf_config(path)
        checkpoint = read_weight_quantization(path)  # GPTQ / AWQ: their linears dequantized, exactly
    model_cls = _MODEL_CLASSES[config.architecture]
    if expert_parallel and not config.moe_layers:
        raise ValueError(f"{path.name}: --enable-expert-parallel needs a mixture-of-experts model, not "
                         f"{config.architecture}")
    shard = TensorParallelShard(config, group.tensor_rank, group.tensor_size, expert_parallel) if parallel else None
    with torch.device("meta"):
        model = model_cls(config) if shard is None else shard.build(model_cls)
    model = model.to(dtype)  # on the meta device: every parameter is then made in its final dtype
    in_blocks: set[str] = set()
    if quantization == "gguf":  # the blocks go in first: their linears' dense matrices are never made
        blocks = _heap_trimmed(split_fused_weights(gguf.block_weights(config), config))
        in_blocks = model.use_block_weights(blocks if shard is None else shard.shard_weights(blocks), device)
        logger.info("%d tensors are read as the file's quantized blocks, in place", len(in_blocks))
    # Buffers that the meta device left empty (rotary tables) are rebuilt on the device, each with its own base.
    for module in model.modules():
        if hasattr(module, "cos"):
            fresh = type(module)(*module.args)
            module.cos, module.sin = fresh.cos.to(device), fresh.sin.to(device)
    _materialize(model, device)
    if dummy:
        _fill_randomly(model)
    else:
        model.load_weights(_progress(_dense_weights(path, config, gguf, checkpoint, shard, in_blocks), path.name,
                                     None if gguf is None else len(gguf.reader.tensors) - len(in_blocks)))
    if quantization in CHECKPOINT_METHODS:  # the same 4-bit blocks, from the checkpoint's groups
        blocks = checkpoint.block_weights(_safetensors_weights(path, checkpoint.is_part, as_float32=True))
        swapped = use_checkpoint_blocks(model, blocks, config, shard)
        logger.info("%d linears read the %s checkpoint's 4-bit groups as blocks", swapped, quantization)
    elif quantization == "int8":
        quantize_linears(model, quantization)
    elif quantization == "fp8":
        logger.info("%d linears quantized to fp8 (e4m3, a scale per output channel)", quantize_linears_to_fp8(model))
    if shard is not None:
        shard.parallelize(model, group)
    if group is not None and group.num_stages > 1:  # pipeline: this rank's run of layers
        model = PipelineStage(model, group)
    model.eval()
    cpu_kernels.for_device(torch.device(device))  # built now (once per machine), not in the first request
    # The dense matrices left (all of a safetensors model's, the experts', a router's) transposed in memory for the
    # CPU kernel, which needs no row padding; once, after every slice and cast.
    laid = lay_out_for_cpu_kernels(model)
    if laid:
        logger.info("%d dense weights laid out for the CPU kernel", laid)
    probe_row_padding(model, dtype)
    _trim_heap()
    logger.info("loaded %s model %s (%s, %s, weights %s%s) in %.1f s", config.architecture, path.name, dtype, device,
                quantization, ", random" if dummy else "", time.perf_counter() - start)
    return model


def _dense_weights(path: Path, config: ModelConfig, gguf: GGUFModelFile | None, checkpoint,
                   shard: TensorParallelShard | None, in_blocks: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors that are not read as blocks, under Hugging Face names (this rank's slices with a ``shard``): a
    GGUF's dequantized one at a time, a directory's as stored (a GPTQ/AWQ checkpoint's linears dequantized)."""
    if gguf is not None:
        weights = gguf.weights(config, skip=in_blocks)
    else:
        tensors = _safetensors_weights(path, as_float32=checkpoint is not None)
        weights = tensors if checkpoint is None else checkpoint.dequantized_weights(tensors)
    weights = split_fused_weights(weights, config)  # Phi-3's fused tensors
    if shard is not None:
        weights = shard.shard_weights(weights)
    # (after the shard: a rank's head may be a slice of a tied embedding, under the head's name)
    return ((name, tensor) for name, tensor in weights if name not in in_blocks)


def _heap_trimmed(items: Iterator) -> Iterator:
    """``items``, with the C heap trimmed after each once its free part passes _KEPT_FREE_HEAP (_trim_heap)."""
    for item in items:
        yield item
        _trim_heap(_KEPT_FREE_HEAP)


def _trim_heap(keep: int = 0) -> None:
    """Gives the pages of the C heap that are free back to the OS, if more than ``keep`` bytes are free. glibc keeps
    a freed allocation under its mmap threshold (which grows to 32 MiB as large ones are freed) for reuse, so a
    load's transient copies, a tensor at a time, would otherwise add up to hundreds of MB of resident memory that
    nothing uses (measured at 1B: 260 MB). Trimming after every tensor gave each next one fresh pages to fault in:
    an 8B Q4_K_M's load took 9.9 s against 6.0 s untrimmed (peak RSS 5.4 against 6.2 GB); keeping up to 256 MiB
    for reuse, benchmarks/README.md has both ("Loading at real sizes")."""
    if _malloc_trim is None:
        return
    if keep and _mallinfo2 is not None and _mallinfo2().fordblks <= keep:
        return
    _malloc_trim(0)


def _materialize(model: torch.nn.Module, device: str | torch.device) -> None:
    """Every parameter and buffer still on the meta device made on ``device`` (uninitialized) in its dtype, one at a
    time; a parameter shared by two modules (a tied head) stays shared."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(_empty_as(param, device), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = _empty_as(buffer, device)


def _empty_as(meta: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``torch.empty_like(meta, device=device)``: not by that call, whose meta-device form imports torch.fx's
    symbolic shapes (0.3 s of a start)."""
    return torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device=device)


@torch.no_grad()
def _fill_randomly(model: torch.nn.Module, seed: int = 0) -> None:
    """--load-format dummy: matrices and embeddings drawn from N(0, 0.02²) (a trained model's scale: activations stay
    finite through any depth), norms' weights 1, biases 0; seeded, so two runs serve the same model."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=generator)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)


def resolve_quantization(path: Path, device: str | torch.device, dtype: torch.dtype,
                         quantization: str, dummy: bool = False, gguf: GGUFModelFile | None = None) -> str:
    """"auto" becomes "gguf" for a GGUF file with matrices in a type the block kernel reads (gguf_file.BLOCK_FORMATS:
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) on the CPU (where the kernel runs; on a GPU the
    blocks would only be dequantized again), "gptq" or "awq" for such a checkpoint on the CPU (the same 4-bit
    blocks), else "none". Measured on an AVX-512 + bf16 CPU
    (benchmarks/bench_engine.py, 2 threads): bfloat16 1.8x the dense tokens/s on one stream and 0.97x at 16
    streams; float32 5.1x and 1.3x. Both before dense float32 weights (and bfloat16 ones where oneDNN has no AMX)
    took the panel kernel too, which made a tiny dense model's one-row decode step 2.4x faster (benchmarks/README.md,
    "Dense weights on the panel kernel"), so the dense side's one stream is faster than these figures say.
    ``gguf``: the file, if the caller has it open (its header is not read again)."""
    if quantization == "gguf" and (path.suffix != ".gguf" or dummy):
        raise ValueError(f"{path.name}: --quantization gguf needs a GGUF file's weights (not --load-format dummy)")
    if quantization == "fp8":  # an old GPU is refused here, before any weight is read
        check_fp8_device(device)
    if dummy and quantization in CHECKPOINT_METHODS:
        raise ValueError(f"{path.name}: --quantization {quantization} needs the checkpoint's weights (not "
                         "--load-format dummy)")
    if dummy:  # random dense weights: "auto" is "none", "int8" and "fp8" quantize them
        return "none" if quantization == "auto" else quantization
    checkpoint = read_weight_quantization(path)
    if quantization in CHECKPOINT_METHODS and (checkpoint is None or checkpoint.method != quantization):
        raise ValueError(f"{path.name}: --quantization {quantization} needs a directory whose config.json has "
                         f"quantization_config.quant_method {quantization!r}")
    if quantization != "auto":
        return quantization
    if torch.device(device).type != "cpu":
        return "none"
    if checkpoint is not None:
        return checkpoint.method
    if path.suffix != ".gguf":
        return "none"
    types = {ggml_type(t.tensor_type)[0] for t in (gguf or GGUFModelFile(path)).reader.tensors}
    return "gguf" if types & BLOCK_FORMATS.keys() else "none"


def has_4bit_blocks(path: Path) -> bool:
    """Whether a GGUF file stores matrices in 4-bit blocks (Q4_0, Q4_1) that the CPU kernel reads in place."""
    if path.suffix != ".gguf":
        return False
    types = {ggml_type(t.tensor_type)[0] for t in GGUFModelFile(path).reader.tensors}
    return bool(types & {"Q4_0", "Q4_1"})


def _progress(weights: Iterator[tuple[str, torch.Tensor]], label: str,
              total: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm import tqdm

    yield from tqdm(weights, desc=f"loading {label}", total=total, unit="tensor", leave=False, delay=1.0)


# safetensors' dtype names → torch's
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def _safetensors_weights(path: Path, keep: Callable[[str], bool] | None = None,
                         as_float32: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors (those whose name ``keep`` accepts) as stored, or floating ones as float32 with
    ``as_float32``. Each is read into memory of its own with a plain read, not through a memory map: a map's pages,
    once touched, count in the process's memory until it is closed (a whole file's worth while loading)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files")
    for file in files:
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
            header.pop("__metadata__", None)
            for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                if keep is not None and not keep(name):
                    continue
                begin, end = entry["data_offsets"]
                data = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(8 + header_size + begin)
                if f.readinto(memoryview(data.numpy())) != end - begin:
                    raise ValueError(f"{file}: tensor {name} ends past the end of the file")
                tensor = data.view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
                yield name, tensor.float() if as_float32 and tensor.is_floating_point() else tensor
