"""Choosing a device, decided once: ``auto | cpu | cuda | cuda:N`` everywhere a user names one."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from .checks import UsageError

log = logging.getLogger("fibattn")
_logged: set = set()


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory_bytes(device) -> int | None:
    """Memory of ``device``: a CUDA device's total, or the host's for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


def torch_build() -> str:
    """This torch and what it was built for: ``torch 2.13.0+cpu, built without CUDA``."""
    cuda = torch.version.cuda
    return f"torch {torch.__version__}, " + (f"built for CUDA {cuda}" if cuda else "built without CUDA")


def check_cuda(name: str, flag: str = "--device", sep: str = " ") -> None:
    """Refuse ``cuda`` / ``cuda:N`` where it cannot run, in one line naming ``flag``, the value and this torch
    build: every command's device check (``sep``: ``=`` for a config key, ``train.device=cuda``)."""
    given = f"{flag}{sep}{name}"
    if not torch.cuda.is_available():
        why = ("no CUDA device is visible (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)"
               if torch.version.cuda else "install a CUDA build of torch to use a GPU (docs/gpu.md)")
        raise UsageError(f"{given}: CUDA is not available here ({torch_build()}); use {flag}{sep}cpu or auto, or "
                         f"{why}")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise UsageError(f"{given}: only {n} CUDA device{'s' if n != 1 else ''} here (cuda:0"
                         f"{f' to cuda:{n - 1}' if n > 1 else ''})")


def valid_name(name: str) -> bool:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    return name in ("auto", "cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())


def resolve_device(name, *, flag: str = "--device", sep: str = " ") -> torch.device:
    """``auto`` is CUDA when available, else CPU (logged once per process and choice); an explicit CUDA
    device that cannot run here is an error naming ``flag`` (:func:`check_cuda`)."""
    name = str(name)
    if name == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if (flag, dev.type) not in _logged:
            _logged.add((flag, dev.type))
            log.info("fibattn: %s auto -> %s", flag, dev)
        return dev
    if valid_name(name):
        if name.startswith("cuda"):
            check_cuda(name, flag, sep)
        return torch.device(name)
    raise UsageError(f"{flag} must be auto, cpu, cuda or cuda:N, got {name!r}")


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (the machine and processor names where it cannot be
    read): what the cpu kernels are built for, and part of their library's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform
    return platform.machine() + platform.processor()


@functools.cache
def cpu_cache_bytes() -> dict[int, int]:
    """CPU 0's caches, ``{level: bytes}`` (Linux sysfs; the largest of a level, so the data cache
    over the instruction cache; empty where they cannot be read)."""
    sizes: dict[int, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip().upper()
            nbytes = int(size.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        except (OSError, ValueError):
            return {}
        sizes[level] = max(sizes.get(level, 0), nbytes)
    return sizes


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (CUDA; a no-op elsewhere): the benches' clocks read after it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
