"""The processes of a model-parallel engine (tensor or pipeline): rank 0 is the engine core's own process; ranks
1..N-1 are started here, load their shard and follow rank 0's steps (ModelRunner.follow) until it shuts them
down."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from serval.config import EngineConfig
from serval.distributed import ParallelGroup, free_init_method, init_group
from serval.engine.runner import ModelRunner
from serval.model.loader import load_model

logger = logging.getLogger(__name__)


def threads_per_rank(world_size: int) -> int:
    """The ranks share this machine's cores (OMP_NUM_THREADS, when set, is each rank's)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // world_size))


@dataclass
class Ranks:
    """Rank 0's hold on the other ranks: the group, their processes, and this process's thread count before."""

    group: ParallelGroup
    processes: list[subprocess.Popen]
    threads_before: int

    def stop(self, timeout: float = 30.0) -> None:
        self.group.broadcast(None)  # the end of the steps
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        self.group.close()
        torch.set_num_threads(self.threads_before)


def start_ranks(config: EngineConfig, model_path: str) -> Ranks:
    """Starts ranks 1..N-1 (fresh interpreters running this module: nothing of the caller's script is re-imported,
    no forked torch threads) and joins the group as rank 0."""
    world = config.world_size
    init_method = free_init_method()
    processes = []
    for rank in range(1, world):
        process = subprocess.Popen([sys.executable, "-c", "from serval.engine.workers import main; main()"],
                                   stdin=subprocess.PIPE)
        process.stdin.write(pickle.dumps((config, str(model_path), rank, world, init_method)))
        process.stdin.close()
        processes.append(process)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(world))
    return Ranks(init_group(0, world, init_method, config.device, config.parallel_kind), processes, threads_before)


def run_worker(config: EngineConfig, model_path: str, rank: int, world_size: int, init_method: str) -> None:
    torch.set_num_threads(threads_per_rank(world_size))
    group = init_group(rank, world_size, init_method, config.device, config.parallel_kind)
    model = load_model(Path(model_path), config.torch_dtype, group.device, config.quantization, group)
    num_blocks = group.broadcast()  # rank 0 sizes the cache (the scheduler's blocks are every rank's)
    runner = ModelRunner(model, num_blocks, config.cache.block_size, config.kv_cache_torch_dtype, group.device,
                         group)
    logger.info("%s-parallel rank %d of %d ready (%d KV blocks)", group.kind, rank, world_size, num_blocks)
    try:
        runner.follow()
    finally:
        group.close()


def main() -> None:
    """A rank's process: its arguments come pickled on stdin."""
    logging.basicConfig(level=os.environ.get("SERVAL_LOG_LEVEL", "WARNING"))
    run_worker(*pickle.loads(sys.stdin.buffer.read()))
