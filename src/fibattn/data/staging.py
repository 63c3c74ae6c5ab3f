"""Staging folders of ``prepare``: marked and locked while their prepare runs, removed by
the next prepare of the same folder once their process is gone (see :mod:`.pipeline`)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from ..config import ConfigError
from ..locks import pid_alive as _pid_alive
from ..locks import try_flock as _lock
from .manifest import MANIFEST_FILE
from .tokenizers import TOKENIZER_FILE

log = logging.getLogger("fibattn")

STAGING_MARKER = ".fibattn-staging"
_MARKER_KIND = "fibattn prepare staging folder"


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


class Staging:
    """The hidden build folder of one prepare, marked and locked while this process lives."""

    def __init__(self, out: Path):
        try:
            self.path = Path(tempfile.mkdtemp(prefix=_staging_prefix(out), dir=out.parent))
        except OSError as exc:
            raise ConfigError(f"data.out_dir: cannot create a folder in {out.parent}: "
                              f"{exc.strerror or exc}; choose another --out") from None
        self.fd = None
        try:
            umask = os.umask(0)
            os.umask(umask)
            self.path.chmod(0o777 & ~umask)
            self.fd = os.open(self.path / STAGING_MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            _lock(self.fd)
            os.write(self.fd, (json.dumps({"kind": _MARKER_KIND, "target": out.name, "pid": os.getpid(),
                                           "host": socket.gethostname()}) + "\n").encode())
        except BaseException:
            self.close()
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def unmark(self) -> None:
        """Remove the marker (just before the folder becomes the prepared folder); keep the lock."""
        try:
            os.unlink(self.path / STAGING_MARKER)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _stale_staging(folder: Path, out: Path) -> bool:
    """True when ``folder`` is a staging folder of ``out`` whose prepare is gone."""
    marker = folder / STAGING_MARKER
    if folder.is_symlink() or not folder.is_dir() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        fd = os.open(marker, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            info = json.loads(os.read(fd, 4096).decode("utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(info, dict) or info.get("kind") != _MARKER_KIND or info.get("target") != out.name:
            return False
        locked = _lock(fd)
        if locked is not None:
            return locked                # not lockable: its prepare still runs (it holds the lock)
        pid = info.get("pid")            # no flock on this platform: the owner's pid, on this host only
        return info.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid)
    finally:
        os.close(fd)


def _stale_old(folder: Path, out: Path) -> bool:
    """True for ``.<name>.old-<pid>`` (left by a force rebuild of earlier fibattn versions, killed
    midway) whose process is gone and which holds only what a prepared folder holds."""
    m = re.fullmatch(re.escape(f".{out.name}.old-") + r"(\d+)", folder.name)
    if not m or folder.is_symlink() or not folder.is_dir():
        return False
    pid = int(m.group(1))
    if pid == os.getpid() or _pid_alive(pid):
        return False
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return False
    return all(n in (MANIFEST_FILE, TOKENIZER_FILE) or n.startswith(".") or re.fullmatch(r"(train|val)_.+\.bin", n)
               for n in names)       # only what a prepared folder holds


def clean_leftovers(out) -> list[Path]:
    """Remove the staging / old folders of ``out`` that killed prepares left (see the module
    docstring); logs one line per folder and returns them."""
    out = Path(out)
    removed = []
    try:
        entries = list(out.parent.iterdir()) if out.parent.is_dir() else []
    except OSError:
        return removed
    for folder in sorted(entries):
        name = folder.name
        if name.startswith(_staging_prefix(out)):
            stale = _stale_staging(folder, out)
        elif name.startswith(f".{out.name}.old-"):
            stale = _stale_old(folder, out)
        else:
            continue
        if not stale:
            continue
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            log.warning("prepare: cannot remove %s, left by an interrupted fibattn prepare: %s", folder, exc)
            continue
        removed.append(folder)
        log.warning("prepare: removed %s, left by an interrupted fibattn prepare of %s", folder, out)
    return removed
