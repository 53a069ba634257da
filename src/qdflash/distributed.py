"""Data-parallel training under torchrun, with PyTorch's own DistributedDataParallel.

The same Hydra app runs in every process (`torchrun --nproc_per_node N -m qdflash.stages.<node> ...`);
the world comes from the environment torchrun sets (WORLD_SIZE, RANK, LOCAL_RANK). Without torchrun
the world has one process and nothing changes.

Why a run on N processes follows the 1-process run: every rank draws the *same* global batch (same
seeds, same random anchors), trains on its slice `[rank::N]`, and divides the sum of its per-token
losses by the token count of the *whole* batch (an all-reduce). DDP then averages the gradients over
ranks, so multiplying the local loss by N gives exactly the gradient of the whole batch's mean loss
(up to float summation order). Only rank 0 writes artifacts, metrics.json and the W&B run
(qdflash.tracking); every rank evaluates (same numbers, so nothing needs gathering).
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
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place, from torchrun's environment (one process when it is not set)."""
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def setup(device: str) -> tuple[World, str]:
    """Join the process group (NCCL on GPUs, gloo on the CPU) and pick this rank's device:
    `cuda` becomes `cuda:<local rank>`."""
    w = world()
    if w.distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda") and w.distributed:
        torch.cuda.set_device(w.local_rank)
        device = f"cuda:{w.local_rank}"
    return w, device


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(items: list, w: World) -> list:
    """This rank's slice of a global batch."""
    return items[w.rank::w.size]


def all_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (a copy; no gradient flows through it)."""
    total = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    return total


def wrap(module: torch.nn.Module, w: World) -> torch.nn.Module:
    """DDP around a module when there is more than one process; the module itself otherwise."""
    if not w.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device = next(module.parameters()).device
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def shard_layers(layers) -> None:
    """FSDP (PyTorch's fully_shard) on each layer: its parameters, gradients and optimizer state are
    split over the ranks and gathered only while the layer runs. For a model whose trained weights
    live in its layers (QAD's latents): the frozen rest stays whole on every rank."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)


def shard_module(module: torch.nn.Module, layers) -> None:
    """FSDP on each layer and on the rest of the module (the root): every trained weight split over
    the ranks, gathered while its forward runs."""
    from torch.distributed.fsdp import fully_shard

    shard_layers(layers)
    fully_shard(module)


def full_state_dict(module: torch.nn.Module) -> dict | None:
    """The whole state dict on rank 0 (CPU tensors; a collective: every rank calls it), None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if world().main else None
