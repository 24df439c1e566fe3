"""Data parallelism through torch.distributed, launched by torchrun (gloo on CPU, NCCL on GPU).

Two strategies for several processes:
- "fsdp" (the default): FSDP2, `torch.distributed.fsdp.fully_shard`. Parameters, gradients and
  optimizer state are sharded across workers; each block (prelude, core, coda layers) is one unit
  that is all-gathered just before it runs. On GPUs the gathered parameters and the compute are
  bfloat16 while gradients are reduced and the sharded master weights kept in float32. The core
  blocks stay gathered from their first iteration to the backward pass: the paper's recurrence reuses
  the same weights r times per step, and re-gathering them every iteration would cost r all-gathers.
  Optional CPU offload keeps the sharded parameters, gradients and optimizer state in host memory.
- "ddp": DistributedDataParallel with a ZeRO-sharded optimizer (ZeroRedundancyOptimizer).

A single process needs none of this: every helper degrades to the one-worker case (FSDP on one
process, e.g. for CPU offload, runs in a one-member process group).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rdlm.resources import check_device

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM


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
    dev = check_device(device)  # refused in one line when this machine lacks it
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if size > 1 and not dist.is_initialized():
        # gloo next to NCCL for the few collectives on CPU tensors (batch bookkeeping, checkpoints).
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo")
        _groups_made.append(size)
    return World(rank, size, local_rank), dev


def init_single_process_group(device: torch.device) -> bool:
    """A one-member process group (FSDP on one process); False when a group exists already."""
    if dist.is_initialized():
        return False
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    _groups_made.append(1)
    return True


STRATEGIES = ("auto", "fsdp", "ddp", "single")


def resolve_strategy(strategy: str, world: World) -> str:
    """auto: fsdp with several processes, a plain single process otherwise."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto":
        return "fsdp" if world.distributed else "single"
    if strategy == "single" and world.distributed:
        raise ValueError(f"strategy 'single' with {world.size} processes: use fsdp or ddp")
    return strategy


def apply_fsdp(
    model: RecurrentDepthLM, device: torch.device, world: World, bf16: bool, cpu_offload: bool = False
) -> RecurrentDepthLM:
    """Shard `model` (a RecurrentDepthLM) in place with FSDP2: one unit per block, the rest at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    # Inputs are not cast: the RoPE tables stay float32 (as Huginn-0125 computes them), and a recomputed
    # (activation-checkpointed) iteration sees the same dtypes as the first pass.
    precision = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        if bf16
        else MixedPrecisionPolicy()
    )
    options: dict[str, Any] = dict(
        mesh=mesh, mp_policy=precision, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    )
    for block in [*model.prelude, *model.coda]:
        fully_shard(block, **options)
    for block in model.core:
        fully_shard(block, reshard_after_forward=False, **options)
    fully_shard(model, **options)  # embedding (tied head), adapter, final norm
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This worker's shard of an FSDP parameter (a DTensor); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP parameter (a collective: every worker must call it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def teardown_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


_groups_made: list[int] = []  # the sizes of the process groups this process created


def exit_process(code: int) -> None:
    """End a program (`python -m rdlm`, the `rdlm` script) with `code`.

    A process that made a process group ends without the interpreter's teardown: gloo's worker threads
    can still hold the last collectives' buffers after `destroy_process_group`, and a thread that
    releases one while the interpreter finalizes needs the GIL it can no longer take, which aborts the
    whole process ("terminate called without an active exception") after a run that succeeded; torchrun
    then reports the worker as failed. Everything the run wrote is already closed and fsynced; only the
    standard streams are flushed here. Any other process exits as usual."""
    if not _groups_made:
        raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can reach it
            stream.flush()
    os._exit(code)
