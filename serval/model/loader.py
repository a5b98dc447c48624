"""Builds a model on a device and dtype from a GGUF file or a Hugging Face directory (safetensors + config.json)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from serval.config import EngineConfig
from serval.distributed import ParallelGroup
from serval.layers import cpu_kernels
from serval.layers.linear import (
    lay_out_for_cpu_kernels,
    probe_row_padding,
    quantize_linears,
    use_activation_quantization,
    use_dot_products,
)
from serval.model.gemma3 import Gemma3ForCausalLM
from serval.model.gguf_file import BLOCK_FORMATS, GGUFModelFile
from serval.model.gptq_awq import METHODS as CHECKPOINT_METHODS
from serval.model.gptq_awq import read_weight_quantization, use_checkpoint_blocks
from serval.model.hf_config import read_hf_config
from serval.model.llama import LlamaForCausalLM, split_fused_weights, use_cpu_layers
from serval.model.parallel import PipelineStage, TensorParallelShard

logger = logging.getLogger(__name__)

# ModelConfig.architecture (a GGUF file's, or the family model/hf_config.py reads) → its model definition.
_MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                  "qwen3": LlamaForCausalLM, "phi3": LlamaForCausalLM, "gemma2": Gemma3ForCausalLM,
                  "gemma3": Gemma3ForCausalLM, "mixtral": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM}


def build_model(path: Path, config: EngineConfig, group: ParallelGroup | None = None, quantization: str | None = None,
                expert_parallel: bool | None = None, loaded: torch.nn.Module | None = None) -> torch.nn.Module:
    """The one recipe for a model the engine runs (the target, a draft, every model-parallel rank's shard): loaded
    as ``config`` (settled) says, ``quantization`` and ``expert_parallel`` where they differ from it (a draft), on
    ``group``'s device when given (or ``loaded`` already, by the caller), then prepared for the runner: the CPU
    block kernel's activation quantization and dot products, and the one-call CPU layers. The dot products chosen
    ("auto" measured; what KV blocks computed by the model depend on) are its ``dot_products``."""
    model = loaded if loaded is not None else load_model(
        path, config.torch_dtype, group.device if group is not None else config.device,
        config.quantization if quantization is None else quantization, group,
        config.enable_expert_parallel if expert_parallel is None else expert_parallel)
    use_activation_quantization(model, config.activation_quantization)
    model.dot_products = use_dot_products(model, config.block_dot_products)
    use_cpu_layers(model, not config.enforce_eager)
    return model


def load_model(path: Path, dtype: torch.dtype, device: str | torch.device = "cpu", quantization: str = "auto",
               group: ParallelGroup | None = None,
               expert_parallel: bool = False) -> LlamaForCausalLM | Gemma3ForCausalLM | PipelineStage:
    """The model in ``dtype`` on ``device``; ``quantization`` as EngineConfig.quantization describes. With a
    ``group`` of several ranks: this rank's tensor-parallel shard of its pipeline stage (model/parallel.py), wrapped
    in a PipelineStage when there are several stages; ``expert_parallel`` (EngineConfig.enable_expert_parallel):
    the shard holds whole experts, not a slice of each."""
    start = time.perf_counter()
    parallel = group is not None and group.tensor_size > 1
    quantization = resolve_quantization(path, device, dtype, quantization)
    if path.suffix == ".gguf":
        gguf = GGUFModelFile(path)
        config = gguf.model_config()
        weights = split_fused_weights(gguf.weights(config), config)  # Phi-3's fused tensors
        total = len(gguf.reader.tensors)
    else:
        config = read_hf_config(path)
        checkpoint = read_weight_quantization(path)  # GPTQ / AWQ: their linears dequantized, exactly
        tensors = _safetensors_weights(path)
        weights = split_fused_weights(tensors if checkpoint is None else checkpoint.dequantized_weights(tensors),
                                      config)
        total = None
    model_cls = _MODEL_CLASSES[config.architecture]
    if expert_parallel and not config.moe_layers:
        raise ValueError(f"{path.name}: --enable-expert-parallel needs a mixture-of-experts model, not "
                         f"{config.architecture}")
    shard = TensorParallelShard(config, group.tensor_rank, group.tensor_size, expert_parallel) if parallel else None
    if shard is not None:
        weights = shard.shard_weights(weights)
    with torch.device("meta"):
        model = model_cls(config) if shard is None else shard.build(model_cls)
    # Materialise on the target device in fp32, load, then cast: loading is exact, casting happens once.
    model = model.to_empty(device=device)
    model.load_weights(_progress(weights, path.name, total))
    model = model.to(dtype)
    # Buffers that the meta device left empty (rotary tables) are rebuilt after the move, each with its own base.
    for module in model.modules():
        if hasattr(module, "cos"):
            fresh = type(module)(*module.args)
            module.cos, module.sin = fresh.cos.to(device), fresh.sin.to(device)
    if quantization == "gguf":
        blocks = split_fused_weights(gguf.block_weights(config), config)
        swapped = model.use_block_weights(blocks if shard is None else shard.shard_weights(blocks))
        logger.info("%d linears read the file's quantized blocks in place", swapped)
    elif quantization in CHECKPOINT_METHODS:  # the same 4-bit blocks, from the checkpoint's groups
        blocks = checkpoint.block_weights(_safetensors_weights(path, checkpoint.is_part))
        swapped = use_checkpoint_blocks(model, blocks, config, shard)
        logger.info("%d linears read the %s checkpoint's 4-bit groups as blocks", swapped, quantization)
    elif quantization == "int8":
        quantize_linears(model, quantization)
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
    logger.info("loaded %s model %s (%s, %s, weights %s) in %.1f s", config.architecture, path.name, dtype, device,
                quantization, time.perf_counter() - start)
    return model


def resolve_quantization(path: Path, device: str | torch.device, dtype: torch.dtype,
                         quantization: str) -> str:
    """"auto" becomes "gguf" for a GGUF file with matrices in a type the block kernel reads (gguf_file.BLOCK_FORMATS:
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) on the CPU (where the kernel runs; on a GPU the
    blocks would only be dequantized again), "gptq" or "awq" for such a checkpoint on the CPU (the same 4-bit
    blocks), else "none". Measured on an AVX-512 + bf16 CPU
    (benchmarks/bench_engine.py, 2 threads): bfloat16 1.8x the dense tokens/s on one stream and 0.97x at 16
    streams; float32 5.1x and 1.3x. Both before dense float32 weights (and bfloat16 ones where oneDNN has no AMX)
    took the panel kernel too, which made a tiny dense model's one-row decode step 2.4x faster (benchmarks/README.md,
    "Dense weights on the panel kernel"), so the dense side's one stream is faster than these figures say."""
    if quantization == "gguf" and path.suffix != ".gguf":
        raise ValueError(f"{path.name}: --quantization gguf needs a GGUF file")
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
    types = {GGMLQuantizationType(t.tensor_type).name for t in GGUFModelFile(path).reader.tensors}
    return "gguf" if types & BLOCK_FORMATS.keys() else "none"


def has_4bit_blocks(path: Path) -> bool:
    """Whether a GGUF file stores matrices in 4-bit blocks (Q4_0, Q4_1) that the CPU kernel reads in place."""
    if path.suffix != ".gguf":
        return False
    types = {GGMLQuantizationType(t.tensor_type).name for t in GGUFModelFile(path).reader.tensors}
    return bool(types & {"Q4_0", "Q4_1"})


def _progress(weights: Iterator[tuple[str, torch.Tensor]], label: str,
              total: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm import tqdm

    yield from tqdm(weights, desc=f"loading {label}", total=total, unit="tensor", leave=False, delay=1.0)


def _safetensors_weights(path: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors (those whose name ``keep`` accepts), floating ones as float32, integer ones (GPTQ's
    and AWQ's packed nibbles) as stored."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    tensor = f.get_tensor(name)
                    yield name, tensor.float() if tensor.is_floating_point() else tensor
