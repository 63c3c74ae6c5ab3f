"""Shards checked against the manifest, with a cache of what was checked.

:func:`verified_shard` opens a shard only after its whole file hashes to the manifest's
sha256 (and its header, token count and token ids agree), so a number computed from
the tokens it returns is computed from the data ``prepare`` wrote. Re-hashing a large
validation split on every evaluation would be slow, so a successful check is remembered:

- in memory, per process, and
- in the data folder's sidecar ``.fibattn-verified.json`` (written atomically, best
  effort: a read-only folder simply keeps no sidecar; a broken one is ignored).

A cache entry names the file and holds its stamp: size, mtime_ns, ctime_ns, inode, the
manifest's sha256 and token count, and the vocabulary size checked against. It is used
only when every part of the stamp is unchanged; any write to the file changes its
ctime (which, unlike mtime, cannot be set back), replacing it changes its inode, and a
changed manifest changes the recorded digest. A file whose timestamps lie within
:data:`RACY_SECONDS` of the check is not cached (a write in the same timestamp tick
could leave its stamp unchanged); it is simply hashed again next time.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..checks import UsageError
from ..files import atomic_write_text, sha256_file
from .shards import ShardError, open_shard

log = logging.getLogger("fibattn")

SIDECAR = ".fibattn-verified.json"
SIDECAR_FORMAT = 1
RACY_SECONDS = 2.0                   # timestamps this close to the check are not trusted
_memory: dict[tuple[str, str], list] = {}
_lock = threading.Lock()


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except FileNotFoundError:
        raise ShardError(f"shard {path} is missing (the manifest lists it)") from None
    except OSError as exc:
        raise ShardError(f"shard {path} cannot be read: {exc.strerror or exc}") from None


def _stamp(st: os.stat_result, rec: dict, vocab_size: int) -> list:
    return [int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns), int(st.st_ino), str(rec["sha256"]),
            int(rec["tokens"]), int(vocab_size)]


def _racy(st: os.stat_result, started_ns: int) -> bool:
    return max(st.st_mtime_ns, st.st_ctime_ns) > started_ns - int(RACY_SECONDS * 1e9)


_digests: dict[str, list] = {}       # absolute path -> [size, mtime_ns, ctime_ns, inode, sha256] of a source file


def file_digest(path, known: list | None = None) -> tuple[str, list | None]:
    """``(sha256, stamp)`` of any file (a source ``prepare`` reads), hashed unless its stamp (size,
    mtime, ctime, inode) equals the one of ``known`` or of this process's last hash of it; the stamp
    is None when it cannot be trusted for the next time (timestamps too recent)."""
    path = Path(path)
    key = str(path.absolute())
    st = path.stat()
    now = [int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns), int(st.st_ino)]
    for cached in (_digests.get(key), known):
        if isinstance(cached, list) and len(cached) == 5 and cached[:4] == now and isinstance(cached[4], str):
            return cached[4], cached
    started = time.time_ns()
    digest = sha256_file(path)
    after = path.stat()
    if [int(after.st_size), int(after.st_mtime_ns), int(after.st_ctime_ns), int(after.st_ino)] != now:
        raise UsageError(f"{path} changed while it was being read; run again once nothing writes to it")
    if _racy(after, started):
        return digest, None
    _digests[key] = [*now, digest]
    return digest, _digests[key]


def _read_sidecar(folder: Path) -> dict:
    try:
        doc = json.loads((folder / SIDECAR).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT or not isinstance(doc.get("files"), dict):
        return {}
    return doc["files"]


def _write_sidecar(folder: Path, name: str, stamp: list) -> None:
    files = _read_sidecar(folder)
    if files.get(name) == stamp:
        return
    files[name] = stamp
    try:
        atomic_write_text(folder / SIDECAR, json.dumps({"format": SIDECAR_FORMAT, "files": files}, indent=1,
                                                       sort_keys=True) + "\n")
    except OSError as exc:               # a read-only data folder: no sidecar, nothing else changes
        log.debug("data: cannot write %s (%s); verification is cached in memory only", folder / SIDECAR, exc)


def _key(folder: Path, name: str) -> tuple[str, str]:
    return str(folder.resolve()), name


def forget(folder=None) -> None:
    """Drop the in-memory cache (of one folder, or all); the sidecar is left as it is."""
    with _lock:
        if folder is None:
            _memory.clear()
        else:
            root = str(Path(folder).resolve())
            for key in [k for k in _memory if k[0] == root]:
                del _memory[key]


def is_cached(folder, rec: dict, vocab_size: int) -> bool:
    """True when the file of ``rec`` has a valid cache entry (memory or sidecar) right now."""
    folder = Path(folder)
    try:
        stamp = _stamp((folder / rec["file"]).stat(), rec, vocab_size)
    except OSError:
        return False
    with _lock:
        if _memory.get(_key(folder, rec["file"])) == stamp:
            return True
    return _read_sidecar(folder).get(rec["file"]) == stamp


def _open_checked(path: Path, rec: dict, *, verify: bool) -> np.ndarray:
    arr = open_shard(path, verify=verify, expected_sha256=rec["sha256"])
    if arr.size != rec["tokens"]:
        raise ShardError(f"shard {path} holds {arr.size} tokens, the manifest says {rec['tokens']}")
    return arr


def verified_shard(folder, rec: dict, vocab_size: int, *, force: bool = False) -> np.ndarray:
    """The tokens of manifest record ``rec`` (``{file, tokens, sha256}``) in ``folder``, verified.

    Raises :class:`ShardError` naming the file when it is missing, truncated, corrupted,
    differs from the manifest, holds a token id ``>= vocab_size`` or changes while being
    checked. ``force``: hash it even when the cache says it is unchanged.
    """
    folder = Path(folder)
    path = folder / rec["file"]
    key = _key(folder, rec["file"])
    st = _stat(path)
    stamp = _stamp(st, rec, vocab_size)
    if not force:
        with _lock:
            hit = _memory.get(key) == stamp
        if hit or _read_sidecar(folder).get(rec["file"]) == stamp:
            arr = _open_checked(path, rec, verify=False)
            if _stamp(_stat(path), rec, vocab_size) == stamp:
                with _lock:
                    _memory[key] = stamp
                return arr
    started = time.time_ns()
    arr = _open_checked(path, rec, verify=True)
    if arr.size and int(arr.max()) >= vocab_size:
        raise ShardError(f"shard {path} holds token id {int(arr.max())}, outside the vocabulary "
                         f"[0, {vocab_size - 1}] of the manifest")
    after = _stat(path)
    if _stamp(after, rec, vocab_size) != stamp:
        raise ShardError(f"shard {path} changed while it was being verified; run again once nothing writes to it")
    if not _racy(after, started):
        with _lock:
            _memory[key] = stamp
        _write_sidecar(folder, rec["file"], stamp)
    return arr
