"""torch.distributed for model parallelism (tensor, pipeline, or both): one process per rank, gloo on the CPU, NCCL
on GPUs.

Rank 0 is the engine (scheduler, runner, sampling); the other ranks hold their shard of the weights and KV cache and
follow rank 0's steps (engine/runner.py ``follow``). Processes rendezvous over TCP (``init_method``), so ranks on
other machines only need rank 0's address and a port they can reach.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def partition(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items split as evenly as can be (the first ranks take the remainder)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def free_init_method(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


@dataclass
class ParallelGroup:
    """This process's place in a group of ranks, and the collectives the model and runner use.

    Ranks are laid out stage by stage: ranks [s * T, (s + 1) * T) are pipeline stage s, and within a stage the T
    ranks split each layer (tensor parallelism). T = world size: tensor parallelism only; T = 1: pipeline only."""

    rank: int
    world_size: int
    device: torch.device
    tensor_size: int = 0  # T, ranks per stage (0: the world, until ``configure``)
    tensor_group: object = None  # the torch.distributed group of this stage's ranks (None: the world's)

    def __post_init__(self) -> None:
        self.tensor_size = self.tensor_size or self.world_size

    def configure(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Lays the ranks out as stages of tensor-parallel ranks. Every rank calls it, in the same order: making
        a group is collective."""
        if tensor_parallel_size * pipeline_parallel_size != self.world_size:
            raise ValueError(f"{tensor_parallel_size} x {pipeline_parallel_size} ranks asked, {self.world_size} "
                             "joined")
        self.tensor_size = tensor_parallel_size
        if 1 < tensor_parallel_size < self.world_size:
            for stage in range(pipeline_parallel_size):
                group = dist.new_group(list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size)))
                if stage == self.stage:
                    self.tensor_group = group

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor_size

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_size

    @property
    def num_stages(self) -> int:
        return self.world_size // self.tensor_size

    def rank_in_stage(self, stage: int) -> int:
        """The rank of ``stage`` that holds this rank's tensor slice: where hidden states go to and come from."""
        return stage % self.num_stages * self.tensor_size + self.tensor_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over this stage's ranks of x, summed in float32 whatever x's dtype (16-bit partial sums would
        round once per rank), returned in x's dtype."""
        total = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(total, group=self.tensor_group)
        return total.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Each of this stage's ranks' x [..., sizes[tensor rank]] joined along the last dimension in rank order."""
        widest = max(sizes)
        padded = torch.nn.functional.pad(x, (0, widest - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.tensor_size)]
        dist.all_gather(parts, padded, group=self.tensor_group)
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)

    def send(self, x: torch.Tensor, dst: int) -> None:
        dist.send(x.contiguous(), dst)

    def isend(self, x: torch.Tensor, dst: int):
        """Starts sending x; the caller keeps x alive and waits on the returned work before reusing it."""
        return dist.isend(x.contiguous(), dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, src)
        return x

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled; tensors come back on this rank's device)."""
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self.device if self.device.type == "cuda" else None)
        return holder[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(rank: int, world_size: int, init_method: str, device: str) -> ParallelGroup:
    """Joins the group (blocks until every rank has); ``ParallelGroup.configure`` lays it out once the ranks know
    the engine's config. On CUDA, rank r takes GPU r of its machine."""
    if device.startswith("cuda"):
        torch_device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(torch_device)
        backend = "nccl"
    else:
        torch_device = torch.device("cpu")
        backend = "gloo"
    # A rank that dies ends the others' waits within this time rather than the default half hour.
    timeout = timedelta(seconds=float(os.environ.get("SERVAL_DIST_TIMEOUT_S", "600")))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return ParallelGroup(rank, world_size, torch_device)
