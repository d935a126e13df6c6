"""torch.distributed set-up for torchrun (NCCL on GPU, gloo on CPU) and small collectives.

A single process without torchrun's environment runs undistributed; every
helper below then degrades to the identity.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle31.config import ConfigError
from eagle31.recipe import Device, choose


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str, local_rank: int) -> torch.device:
    requested = choose(Device, requested, "train.device")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is available (use train.device=cpu or auto)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_world(device: str = "auto") -> World:
    """Join torchrun's process group when launched by it (multi-node works through its rendezvous)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    elif dev.type == "cuda":
        ensure_single_process_group(dev)  # FSDP2 (mixed precision) runs on one GPU too
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def ensure_single_process_group(device: torch.device) -> None:
    """A one-process NCCL group on localhost, for FSDP2 without torchrun."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place); identity when undistributed.

    `x` must be on the world's device (`World.device`): NCCL refuses a tensor in host
    memory ("Tensors must be CUDA and dense"), gloo would take it and hide the bug.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def broadcast_object(obj, device: torch.device, src: int = 0):
    """`obj` (picklable) from rank `src` to every rank, staged on the world's `device` (NCCL needs CUDA memory)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=device)
        return box[0]
    return obj


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

