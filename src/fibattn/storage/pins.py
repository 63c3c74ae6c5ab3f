"""Pins: a checkpoint a process reads is kept from being pruned meanwhile.

A pin is a shared ``flock`` on the checkpoint's ``meta.json``, which :func:`.checkpoint.prune`
must lock exclusively before it deletes the folder; the kernel drops it when the process ends.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..locks import try_flock

META = "meta.json"

_pins: dict[str, int] = {}               # checkpoint folder -> the pin this process holds on it


def pin(path) -> bool:
    """Keep checkpoint folder ``path`` from being pruned while this process reads it: a shared lock on its
    ``meta.json`` (which :func:`prune` must lock exclusively), held until the process exits (or
    :func:`unpin`); nothing is written. False when the folder is gone or incomplete once the pin holds
    (pruned meanwhile)."""
    path = Path(path)
    key = str(path.absolute())
    if key in _pins:
        return (path / META).is_file()
    try:
        fd = os.open(path / META, os.O_RDONLY)
    except OSError:
        return False
    try_flock(fd, shared=True, block=True)            # waits while a pruner deletes it
    if not (path / META).is_file() or os.fstat(fd).st_ino != (path / META).stat().st_ino:
        os.close(fd)
        return False
    _pins[key] = fd
    return True


def unpin(path) -> None:
    fd = _pins.pop(str(Path(path).absolute()), None)
    if fd is not None:
        os.close(fd)
