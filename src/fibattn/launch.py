"""The process's place in a ``torchrun`` job, read once from the environment and checked as a whole
(issue 58, kind 9): every command that reads it (``train``, ``eval --context-parallel``, grids) calls
:func:`launch`.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` together. None of the first four set: one process. Some set by hand and others missing
(or not integers, or out of range) is refused in one line naming the variable, instead of a traceback
from torch's rendezvous or a job that quietly runs as rank 0 of one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .checks import UsageError

PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK")                # LOCAL_WORLD_SIZE defaults to WORLD_SIZE
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")                   # needed when there is more than one process


class LaunchError(UsageError):
    """torchrun's environment is incomplete or inconsistent (one line naming the variable)."""


@dataclass(frozen=True)
class Launch:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _set(env, name: str) -> bool:
    return env.get(name, "").strip() != ""


def _int(env, name: str, lo: int, hi: int | None = None) -> int:
    raw = env[name].strip()
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise LaunchError(f"environment variable {name} must be an integer {allowed}, got {value}")
    return value


def launch(environ=None) -> Launch:
    """This process's :class:`Launch` (one process without torchrun's variables); :class:`LaunchError`
    naming the variable when they are set in part or do not agree."""
    env = os.environ if environ is None else environ
    given = [n for n in PLACE if _set(env, n)]
    if not given:
        return Launch()
    missing = [n for n in NEEDED if not _set(env, n)]
    if missing:
        raise LaunchError(f"environment variable {missing[0]} is not set, but {' and '.join(given)} "
                          f"{'is' if len(given) == 1 else 'are'}: torchrun sets {', '.join(NEEDED + RENDEZVOUS)} "
                          f"together; start the job with torchrun, or unset {' and '.join(given)} for one process")
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    if rank >= world:
        raise LaunchError(f"environment variable RANK must be below WORLD_SIZE ({world}), got {rank}")
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1, world) if _set(env, "LOCAL_WORLD_SIZE") else world
    local_rank = _int(env, "LOCAL_RANK", 0)
    if local_rank >= local_world:
        raise LaunchError(f"environment variable LOCAL_RANK must be below LOCAL_WORLD_SIZE ({local_world}), got "
                          f"{local_rank}")
    if world > 1:
        for name in RENDEZVOUS:
            if not _set(env, name):
                raise LaunchError(f"environment variable {name} is not set, but WORLD_SIZE is {world}: the "
                                  f"processes meet at MASTER_ADDR:MASTER_PORT (torchrun sets both); start the job "
                                  f"with torchrun")
        _int(env, "MASTER_PORT", 1, 65535)
    return Launch(rank, world, local_rank, local_world)
