"""The processes of a model-parallel engine (tensor, pipeline, or both): rank 0 is the engine core's own process; ranks
1..N-1 load their shard and follow rank 0's steps (ModelRunner.follow) until it shuts them down.

On one machine rank 0 starts them all here. Across machines (``EngineConfig.dist_init_method``, a TCP address the
other machines reach) rank 0 starts only its machine's share (``num_local_ranks``) and the others are started there
with `serval rank --dist-init-method ... --rank R --world-size N`: every rank learns the engine's config from rank 0
once the group has formed, and checks it holds the same model file."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from serval.config import EngineConfig
from serval.distributed import ParallelGroup, free_init_method, init_group
from serval.engine.runner import ModelRunner
from serval.lifetime import ending_with_parent
from serval.model.loader import build_model
from serval.model.registry import resolve_model_path
from serval.platform_info import ThreadPlan, plan_threads

logger = logging.getLogger(__name__)


def threads_per_rank(world_size: int, plan: ThreadPlan | None = None) -> int:
    """The ranks share the CPUs this process may use (platform_info.plan_threads: affinity and cgroup quota, not the
    machine's core count); OMP_NUM_THREADS, when set, is each rank's."""
    plan = plan or plan_threads()
    return plan.threads if plan.omp_num_threads else max(1, plan.threads // world_size)


def use_threads(world_size: int) -> ThreadPlan:
    """Sets this process's CPU threads (torch's intra-op threads, which run the C++ kernels too) to as many as it may
    use, and logs the choice and why. Model-parallel ranks share them out in start_ranks."""
    plan = plan_threads()
    if world_size == 1 and torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    # A warning where threads may spin on shared cores: that cost up to 50x beside one busy process (issue 51).
    logger.log(logging.WARNING if plan.waits_too_late else logging.INFO, "%s%s", plan.describe(),
               "; this machine's ranks share them" if world_size > 1 else "")
    return plan


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


def model_identity(model_path: str) -> tuple[str, int]:
    """What ranks compare to know they hold the same weights: the file's name and size."""
    path = Path(model_path)
    return path.name, path.stat().st_size if path.is_file() else -1


def start_ranks(config: EngineConfig, model_path: str) -> Ranks:
    """Starts this machine's ranks 1..K-1 (fresh interpreters running this module: nothing of the caller's script is
    re-imported, no forked torch threads), joins the group as rank 0 (waiting for the ranks of other machines, if
    any) and tells every rank the config."""
    world = config.world_size
    init_method = config.dist_init_method or free_init_method()
    local = config.num_local_ranks or (1 if config.dist_init_method else world)
    processes = []
    for rank in range(1, local):
        process = subprocess.Popen([sys.executable, "-c", "from serval.engine.workers import main; main()"],
                                   stdin=subprocess.PIPE, preexec_fn=ending_with_parent(signal.SIGKILL))
        process.stdin.write(pickle.dumps((rank, world, init_method, config.device, str(model_path), local)))
        process.stdin.close()
        processes.append(process)
    if local < world:
        logger.warning("waiting for ranks %d..%d to join at %s (serval rank --dist-init-method %s --rank R "
                       "--world-size %d, on their machines)", local, world - 1, init_method, init_method, world)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(local))
    group = init_group(0, world, init_method, config.device)
    group.broadcast((config, model_identity(model_path)))
    group.configure(config.tensor_parallel_size, config.pipeline_parallel_size)
    return Ranks(group, processes, threads_before)


def run_worker(rank: int, world_size: int, init_method: str, device: str, model_path: str | None,
               num_local_ranks: int = 1) -> None:
    """Rank ``rank``'s life: join, learn the config from rank 0, load this rank's shard, follow the steps.
    ``model_path`` None: the model rank 0's config names, found on this machine."""
    torch.set_num_threads(threads_per_rank(num_local_ranks))
    group = init_group(rank, world_size, init_method, device)
    config, identity = group.broadcast()
    group.configure(config.tensor_parallel_size, config.pipeline_parallel_size)
    model_path = str(resolve_model_path(model_path or config.model))
    if model_identity(model_path) != identity:
        group.close()
        raise RuntimeError(f"rank {rank}: {model_path} is {model_identity(model_path)} (name, bytes); rank 0 "
                           f"serves {identity}: every rank needs the same model file")
    model = build_model(Path(model_path), config, group)
    num_blocks = group.broadcast()  # rank 0 sizes the cache (the scheduler's blocks are every rank's)
    runner = ModelRunner(model, num_blocks, config.cache.block_size, config.kv_cache_torch_dtype, group.device,
                         group)
    logger.info("rank %d of %d ready: pipeline stage %d, tensor-parallel rank %d (%d KV blocks)", rank, world_size,
                group.stage, group.tensor_rank, num_blocks)
    try:
        runner.follow()
    finally:
        group.close()


def main() -> None:
    """A rank's process: its arguments come pickled on stdin."""
    logging.basicConfig(level=os.environ.get("SERVAL_LOG_LEVEL", "WARNING"))
    run_worker(*pickle.loads(sys.stdin.buffer.read()))
