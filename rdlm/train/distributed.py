"""Data parallelism through torch.distributed, launched by torchrun (gloo on CPU, NCCL on GPU).

A single process needs none of this: every helper degrades to the one-worker case.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def setup(device: str = "auto") -> tuple[World, torch.device]:
    """Join the process group torchrun describes (if any) and pick this worker's device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return World(rank, size, local_rank), dev


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def teardown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
