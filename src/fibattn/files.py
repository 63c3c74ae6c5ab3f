"""Files fibattn writes and checks: atomic writes (a temp file in the same folder, fsync, then
rename) and the size + sha256 listings that checkpoints and exports verify against."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())      # mkstemp creates 0600; give the usual mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_dir(path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def listed_file_problem(path, info: dict, data: bytes | None = None) -> str | None:
    """How ``path`` differs from its listing ``{"bytes": n, "sha256": hex}`` — ``is missing``,
    ``is truncated or changed (...)`` or ``is corrupted (sha256 mismatch)`` — or None when it
    matches. ``data``: the file's bytes when the caller has read them already."""
    path = Path(path)
    if data is None and not path.is_file():
        return "is missing"
    size = len(data) if data is not None else path.stat().st_size
    if size != info["bytes"]:
        return f"is truncated or changed ({size} bytes, expected {info['bytes']})"
    digest = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
    if digest != info["sha256"]:
        return "is corrupted (sha256 mismatch)"
    return None
