"""One writer per folder, and pins that keep a checkpoint from being pruned while it is read.

:class:`FolderLock` is the one lock for a folder fibattn writes (a run folder, a data folder
being prepared): a small file holding the holder's pid and host, with an exclusive
``fcntl.flock`` held for the life of the process (the kernel drops it when the process dies,
however it dies). A second writer meets :class:`LockedError` naming the holder's pid; a lock
file left by a dead process (not locked, pid recorded) is taken over with a notice.

:func:`try_flock` is the primitive both use, and so do the prepare staging markers and the
checkpoint reader pins (a shared lock the pruner's exclusive attempt respects).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from .checks import ConfigError

log = logging.getLogger("fibattn")


class LockedError(ConfigError):
    """Another live process holds the lock (the message names its pid)."""


def try_flock(fd: int, *, shared: bool = False, block: bool = False) -> bool | None:
    """Lock ``fd`` (exclusive unless ``shared``): True when taken, False when another open file
    holds a conflicting lock, None where this platform has no ``flock``."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if block else fcntl.LOCK_NB))
        return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _holder(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class FolderLock:
    """An exclusive, process-lifetime lock on ``path`` (the lock file); see the module docstring."""

    def __init__(self, path, folder, setting: str, what: str):
        self.path, self.folder, self.setting, self.what, self.fd = Path(path), Path(folder), setting, what, None

    def acquire(self) -> "FolderLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot create the lock file {self.path} ({self.setting}): "
                                         f"{exc.strerror or exc}") from None
            got = try_flock(fd)
            info = _holder(fd)
            pid = info.get("pid")
            if got is None and isinstance(pid, int) and pid != os.getpid() and pid_alive(pid) \
                    and info.get("host") == socket.gethostname():
                got = False                     # no flock here: a live recorded pid holds it
            if got is False:
                for _ in range(20):             # the holder writes its pid just after locking
                    if isinstance(info.get("pid"), int):
                        break
                    time.sleep(0.05)
                    info = _holder(fd)
                os.close(fd)
                raise _in_use(self.path, self.folder, self.setting, info)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except OSError:
                same = False
            if not same:                        # its holder removed the file meanwhile: lock the new one
                os.close(fd)
                continue
            break
        if isinstance(pid, int):
            log.warning("fibattn: took over the lock %s of process %d on %s, which is gone", self.path, pid,
                        info.get("host", "?"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": self.what})
                       + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (removed first, so no one locks a file about to go)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _in_use(path: Path, folder: Path, setting: str, info: dict) -> LockedError:
    pid = info.get("pid")
    return LockedError(f"{setting} {folder} is in use: {info.get('what') or 'a fibattn process'} by process "
                       f"{pid if isinstance(pid, int) else '?'} on {info.get('host', '?')} (lock file {path}); "
                       f"wait for it to finish or choose another {setting}")


def check_unlocked(path, folder, setting: str) -> None:
    """Fail now (writing nothing) when a live process holds the lock file ``path``; the real lock is
    taken later, right before writing."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        got = try_flock(fd, shared=True)
        info = _holder(fd)
        pid = info.get("pid")
        if got is None:
            got = not (isinstance(pid, int) and pid_alive(pid) and info.get("host") == socket.gethostname())
        if not got:
            raise _in_use(path, Path(folder), setting, info)
    finally:
        os.close(fd)


def drop_stale(path) -> bool:
    """Remove lock file ``path`` when no live process holds it (its writer was killed), with a notice."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        info = _holder(fd)
        if try_flock(fd) is not True or not isinstance(info.get("pid"), int):
            return False              # held, or not a lock file fibattn finished writing
        os.unlink(path)
    except OSError:
        return False
    finally:
        os.close(fd)
    log.warning("fibattn: removed the lock %s of process %d on %s, which is gone", path, info["pid"],
                info.get("host", "?"))
    return True
