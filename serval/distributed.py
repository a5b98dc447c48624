"""torch.distributed for model parallelism (tensor or pipeline): one process per rank, gloo on the CPU, NCCL on GPUs.

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
    """This process's place in a group of ranks, and the collectives the model and runner use."""

    rank: int
    world_size: int
    device: torch.device
    kind: str = "tensor"  # "tensor": every rank holds a slice of every layer; "pipeline": a run of whole layers

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, summed in float32 whatever x's dtype (16-bit partial sums would round once per
        rank), returned in x's dtype."""
        total = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(total)
        return total.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Each rank's x [..., sizes[rank]] joined along the last dimension in rank order."""
        widest = max(sizes)
        padded = torch.nn.functional.pad(x, (0, widest - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
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


def init_group(rank: int, world_size: int, init_method: str, device: str, kind: str = "tensor") -> ParallelGroup:
    """Joins the group (blocks until every rank has). On CUDA, rank r takes GPU r of its machine."""
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
    return ParallelGroup(rank, world_size, torch_device, kind)
