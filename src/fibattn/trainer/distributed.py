"""Process-group setup from ``torchrun``'s environment, device choice and small collectives.

Under ``torchrun`` (single or multi-node) ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
are set; with ``WORLD_SIZE > 1`` a process group is created (``nccl`` on CUDA, ``gloo``
on CPU) and each process uses ``cuda:LOCAL_RANK`` (or the CPU). Without them, or with
``WORLD_SIZE=1``, training runs in one process and nothing is initialised.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..config import ConfigError, TrainConfig

log = logging.getLogger("fibattn")


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    initialised: bool = False          # True when this module created the process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None


def pick_device(t: TrainConfig, local_rank: int, world_size: int) -> torch.device:
    if t.device == "cpu":
        return torch.device("cpu")
    if t.device.startswith("cuda:") and world_size > 1:
        raise ConfigError(f"train.device={t.device} cannot be used with WORLD_SIZE={world_size}: each process uses "
                          f"cuda:LOCAL_RANK; set train.device=cuda or auto")
    if t.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={t.device} but CUDA is not available here; use train.device=cpu or auto")
        if t.device == "cuda":
            return torch.device("cuda", local_rank)
        index = int(t.device[5:])
        if index >= torch.cuda.device_count():
            raise ConfigError(f"train.device={t.device} but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device("cuda", index)
    chosen = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    log.info("fibattn: train.device auto -> %s", chosen)
    return chosen


def init(t: TrainConfig) -> DistInfo:
    """Read torchrun's variables, pick the device, create the process group if needed."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} / WORLD_SIZE={world} from the environment are inconsistent")
    device = pick_device(t, local_rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = DistInfo(rank, world, local_rank, local_world, device)
    if world > 1 and not tdist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        tdist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world, **kwargs)
        info.initialised = True
        if rank == 0:
            log.info("fibattn: distributed training on %d processes (%s)", world, backend)
    return info


def shutdown(info: DistInfo) -> None:
    if info.initialised and tdist.is_initialized():
        tdist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        if info.device.type == "cuda":
            tdist.barrier(device_ids=[info.device.index])
        else:
            tdist.barrier()


def all_reduce_sum(info: DistInfo, x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place, returns ``x``); a no-op in one process."""
    if info.distributed:
        tdist.all_reduce(x, op=tdist.ReduceOp.SUM)
    return x


def broadcast_int(info: DistInfo, value: int) -> int:
    """Rank 0's ``value`` on every rank (a tensor broadcast: no pickling)."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    tdist.broadcast(t, src=0)
    return int(t.item())
