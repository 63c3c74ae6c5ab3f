"""Choosing a device, decided once: ``auto | cpu | cuda | cuda:N`` everywhere a user names one."""
from __future__ import annotations

import logging
import os

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


def resolve_device(name, *, flag: str = "--device") -> torch.device:
    """``auto`` is CUDA when available, else CPU (logged once per process and choice); an
    explicit CUDA device without CUDA is an error naming ``flag``."""
    name = str(name)
    if name == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if (flag, dev.type) not in _logged:
            _logged.add((flag, dev.type))
            log.info("fibattn: %s auto -> %s", flag, dev)
        return dev
    if name == "cpu" or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"{flag} {name} but CUDA is not available here; use {flag} cpu or auto")
        return torch.device(name)
    raise UsageError(f"{flag} must be auto, cpu, cuda or cuda:N, got {name!r}")
