"""CPU threads for torch, decided once for every command (``train.threads``, ``--threads``).

A count given is used as it is. 0 (the default) takes the cores that are free now, not torch's default of
every core: torch's OpenMP threads wait for each other at the end of every operation, so on a machine whose
cores are busy with other work one descheduled thread stalls all of them (measured: 400 tiny-preset steps
took 24 min on torch's default threads beside other work, 150 took 42 s on one thread). Free cores are the
cores this process may use less their share of the machine's one-minute load average; ``OMP_NUM_THREADS``
set by the user is respected as torch's default. The choice is logged once per process.
"""
from __future__ import annotations

import logging
import os

import torch

from .checks import UsageError

log = logging.getLogger("fibattn")
TORCH_DEFAULT = torch.get_num_threads()      # before anything here changes it
MAX_THREADS = 1024                           # torch takes any count and would start that many threads
_told: set = set()


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all cores where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(usable: int, load: float | None = None, machine: int | None = None) -> float:
    """How many of the ``usable`` cores other work keeps busy: the one-minute load average spread over the
    ``machine``'s cores (a container sees the host's load and core count), times ``usable``."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0
    machine = machine or os.cpu_count() or usable
    return usable * min(1.0, max(0.0, load) / max(machine, 1))


def default_threads(processes: int = 1, *, usable: int | None = None, busy: float | None = None,
                    torch_default: int | None = None) -> tuple[int, str]:
    """The default thread count for one of ``processes`` processes on this machine and why: the free cores
    (usable less busy, rounded) shared among the processes, at most torch's default and at least 1."""
    usable = usable_cores() if usable is None else usable
    busy = busy_cores(usable) if busy is None else busy
    cap = TORCH_DEFAULT if torch_default is None else torch_default
    if "OMP_NUM_THREADS" in os.environ and torch_default is None:
        return max(1, cap // max(processes, 1)), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    free = max(1, int(usable - busy + 0.5))
    n = max(1, min(cap, free // max(processes, 1)))
    share = f", shared by {processes} processes" if processes > 1 else ""
    return n, f"{free} of {usable} cores free, {busy:.1f} busy by the load average{share}"


def use_threads(requested: int = 0, setting: str = "--threads", processes: int = 1, tell: bool = True) -> int:
    """Set torch's CPU threads: ``requested`` when > 0, else :func:`default_threads` (logged once per process
    and count where ``tell``); returns the count set."""
    if isinstance(requested, bool) or not isinstance(requested, int) or not 0 <= requested <= MAX_THREADS:
        raise UsageError(f"{setting} must be an integer from 0 to {MAX_THREADS} (0: the free cores), got "
                         f"{requested!r}")
    if requested:
        torch.set_num_threads(requested)
        return requested
    n, why = default_threads(processes)
    torch.set_num_threads(n)
    if tell and n not in _told:
        _told.add(n)
        choose = f"{setting} N" if setting.startswith("-") else f"{setting}=N"
        log.info("fibattn: %s auto -> %d CPU thread%s (%s; torch's default %d; %s chooses)",
                 setting, n, "s" if n != 1 else "", why, TORCH_DEFAULT, choose)
    return n
