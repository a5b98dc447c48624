"""Worker: the model and what runs it, in the engine core's process. The core schedules; the worker runs.

It owns the weights (model/loader.py's ``build_model``, the one recipe for the target, a draft and every rank's
shard), the model-parallel ranks that hold the other shards (workers.py), the KV cache's size (memory_profile.py),
the runner that executes each step (runner.py), a draft model's proposer, and the worker's side of the KV
connectors: the device's copies to and from an offload tier (kv_offload.BlockStore) and a prefill or decode
worker's transport (kv_transfer.ZmqKVConnector). What it can run is stated once, here: ``max_decode_steps``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from serval.config import EngineConfig
from serval.engine.cuda_graphs import DecodeBuckets
from serval.engine.kv_offload import BlockStore
from serval.engine.kv_transfer import ZmqKVConnector
from serval.engine.memory_profile import num_kv_blocks
from serval.engine.runner import ModelRunner, kv_cache_block_bytes
from serval.engine.spec_decode import NgramProposer
from serval.engine.workers import start_ranks, use_threads
from serval.model.loader import build_model, has_4bit_blocks
from serval.model.registry import resolve_model_path

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, model_path: Path, model=None) -> None:
        """Loads the model at ``model_path`` as ``config`` (settled) says, or prepares an already loaded ``model``
        of the same dtype and device; sizes the KV cache and builds the runner."""
        if model is not None and config.world_size > 1:
            raise ValueError("a loaded model cannot be split over ranks: let the engine load it")
        self.config = config
        self.model_path = Path(model_path)
        self.threads = use_threads(config.world_size)
        # Model parallelism: this process is rank 0 (schedules, samples); the other ranks follow its steps.
        self.ranks = start_ranks(config, str(model_path)) if config.world_size > 1 else None
        self.group = self.ranks.group if self.ranks is not None else None
        self.model = build_model(self.model_path, config, self.group, loaded=model)
        self.num_blocks = num_kv_blocks(config, self.model)  # on a GPU, after a profiling forward of the largest step
        if self.group is not None:
            self.group.broadcast(self.num_blocks)
        # A request alone must always fit, or preemption could never make room for it.
        self.max_model_len = min(config.max_model_len or self.model.config.max_position,
                                 self.num_blocks * config.cache.block_size)
        self.runner = ModelRunner(self.model, self.num_blocks, config.cache.block_size, config.kv_cache_torch_dtype,
                                  config.device, self.group, self._decode_buckets())
        self.proposer = self._make_proposer()
        # Forwards of decodes this worker runs in a row (multi-step decoding), stated once: the config's, or 1 where
        # every forward is mirrored one at a time (a draft model keeps its cache up, model-parallel ranks follow).
        mirrored = self.runner.draft is not None or self.group is not None
        self.max_decode_steps = 1 if mirrored else config.scheduler.num_scheduler_steps

    def _decode_buckets(self) -> DecodeBuckets | None:
        """Padded decode buckets (captured in CUDA graphs) on a GPU, unless --enforce-eager; model-parallel ranks run
        eagerly."""
        config = self.config
        on_gpu = config.device.startswith("cuda")
        if config.enforce_eager or self.group is not None or not (on_gpu or config.pad_decode_on_cpu):
            return None
        return DecodeBuckets(config.scheduler.max_num_seqs, self.max_model_len, capture=on_gpu,
                             multi_step=config.scheduler.num_scheduler_steps > 1)

    def _make_proposer(self):
        """Speculation's guesser: n-gram lookup, the target's first layers, or a draft model of its own (loaded here
        and run by the runner after each step's forward, so that its cache keeps up)."""
        from serval.engine.draft_proposer import DraftProposer

        spec, config = self.config.speculative, self.config
        if not spec.enabled:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        layers = spec.early_exit_layers
        if layers is not None:
            if layers >= self.model.config.num_layers:
                raise ValueError(f"--speculative-model self-layers:{layers}: the model has only "
                                 f"{self.model.config.num_layers} layers")
            return DraftProposer(self.runner, self.model, layers)
        if spec.method == "self-int4":  # the target's own file, read in its 4-bit blocks by the CPU kernel
            if not has_4bit_blocks(self.model_path):
                raise ValueError("--speculative-model self-int4 needs a GGUF file with Q4_0 or Q4_1 matrices; "
                                 f"{self.model_path.name} has none")
            draft_model = build_model(self.model_path, config, quantization="gguf", expert_parallel=False)
        else:
            draft_model = build_model(resolve_model_path(spec.draft_model), config, expert_parallel=False)
        self.runner.draft = proposer = DraftProposer(self.runner, draft_model)  # mirrors each step's forward
        return proposer

    def fingerprint(self) -> dict:
        """What KV blocks depend on: the same weights read the same way, and the cache's own dtype."""
        path, config = self.model_path, self.config
        return {"model": path.name, "bytes": path.stat().st_size if path.is_file() else None,
                "dtype": config.dtype, "quantization": config.quantization,
                "kv_cache_dtype": config.cache.kv_cache_dtype,
                "activation_quantization": self.model.activation_quantization, "dot_products": self.model.dot_products}

    # -- the worker's side of the KV connectors ------------------------------------------------------------------
    def offload_store(self) -> BlockStore | None:
        """The device's copies to and from the offload tier (--kv-offload-size), or None without one."""
        cache = self.config.cache
        if not cache.kv_offload_size:
            return None
        block_bytes = kv_cache_block_bytes(self.model.config, cache.block_size, self.config.kv_cache_torch_dtype)
        num_slots = int(cache.kv_offload_size * 2**30 // block_bytes)
        if num_slots < 1:
            raise ValueError(f"CacheConfig.kv_offload_size={cache.kv_offload_size} GiB holds no KV block "
                             f"({block_bytes} bytes)")
        # What the blocks of a disk tier are worth to a later run: the same weights, read the same way.
        return BlockStore(num_slots, self.runner.kv_cache, cache.kv_offload_path, self.fingerprint())

    def kv_transfer(self) -> ZmqKVConnector | None:
        """A prefill or decode worker's transport of KV blocks (--role), or None."""
        config = self.config
        if config.kv_transfer.role == "both":
            return None
        return ZmqKVConnector(config.kv_transfer, self.runner.kv_cache,
                              {**self.fingerprint(), "block_size": config.cache.block_size})

    def shutdown(self) -> None:
        """Stops the model-parallel ranks."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = self.group = None
