"""Binary token shards: a 64-byte header followed by the raw token ids (little-endian).

Header layout (``struct`` format ``<8sIIQ32s8x``)::

    0   8 bytes  magic  b"FIBTOKEN"
    8   uint32   format version (1)
    12  uint32   dtype code = bytes per token: 2 (uint16, vocab <= 65536) or 4 (uint32)
    16  uint64   token count
    24  32 bytes sha256 of the payload (the token bytes that follow the header)
    56  8 bytes  reserved (zero)

A shard is written atomically (temp file + rename) and opened read-only with
``numpy.memmap``. Opening always checks magic, version, dtype and that the file size is
exactly ``64 + count * itemsize``; ``verify=True`` also re-hashes the payload. Every
failure is a :class:`ShardError` that names the file.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checks import UsageError
from ..files import atomic_write_bytes

MAGIC = b"FIBTOKEN"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ32s8x")
HEADER_BYTES = HEADER.size
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_HASH_CHUNK = 1 << 24


class ShardError(UsageError):
    """A missing, truncated, corrupted or foreign shard file (the message names it)."""


@dataclass(frozen=True)
class ShardHeader:
    version: int
    dtype: np.dtype
    count: int
    payload_sha256: str


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise UsageError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return _DTYPES[2] if vocab_size <= 1 << 16 else _DTYPES[4]


def _sha256_array(arr: np.ndarray) -> hashlib._Hash:
    h = hashlib.sha256()
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    for start in range(0, flat.size, _HASH_CHUNK):
        h.update(flat[start:start + _HASH_CHUNK])
    return h


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_HASH_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def write_shard(path, tokens: np.ndarray, dtype: np.dtype) -> dict:
    """Write ``tokens`` (1-D ints) as a shard; returns ``{file, tokens, bytes, sha256}`` (sha of the file)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    if dtype.itemsize not in _DTYPES:
        raise UsageError(f"shard dtype must be uint16 or uint32, got {dtype}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise UsageError(f"shard tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(dtype).max):
        raise UsageError(f"token ids {int(tokens.min())}..{int(tokens.max())} do not fit {dtype.name}")
    payload = tokens.astype(dtype, copy=False)
    digest = _sha256_array(payload).digest()
    header = HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, payload.size, digest)
    data = header + payload.tobytes()
    atomic_write_bytes(path, data)
    return {"file": Path(path).name, "tokens": int(payload.size), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def read_header(path) -> ShardHeader:
    """Parse and check a shard header against the file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(HEADER_BYTES)
    except FileNotFoundError:
        raise ShardError(f"shard {path} is missing") from None
    except OSError as exc:                  # a folder in its place, no permission, an I/O error
        raise ShardError(f"shard {path} cannot be read: {exc.strerror or exc}") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"shard {path} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, code, count, digest = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ShardError(f"shard {path} is not a fibattn token shard (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise ShardError(f"shard {path} has format version {version}; this fibattn reads version {FORMAT_VERSION}")
    if code not in _DTYPES:
        raise ShardError(f"shard {path} has unknown dtype code {code} (allowed: 2 = uint16, 4 = uint32)")
    expected = HEADER_BYTES + count * code
    if size != expected:
        what = "truncated" if size < expected else "too long"
        raise ShardError(f"shard {path} is {what}: {size} bytes on disk, header says "
                         f"{count} tokens x {code} bytes + {HEADER_BYTES} = {expected}")
    return ShardHeader(version, _DTYPES[code], count, digest.hex())


def open_shard(path, *, verify: bool = False, expected_sha256: str | None = None) -> np.ndarray:
    """Memory-map a shard's tokens (read-only 1-D array); ``verify`` re-hashes the payload.

    ``expected_sha256`` (the manifest's digest of the whole file) is checked when ``verify``.
    """
    path = Path(path)
    header = read_header(path)
    if header.count == 0:
        tokens = np.zeros(0, dtype=header.dtype)
    else:
        tokens = np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_BYTES, shape=(header.count,))
    if verify:
        got = _sha256_array(tokens).hexdigest()
        if got != header.payload_sha256:
            raise ShardError(f"shard {path} is corrupted: payload sha256 {got} does not match its header "
                             f"({header.payload_sha256})")
        if expected_sha256 is not None:
            whole = file_sha256(path)
            if whole != expected_sha256:
                raise ShardError(f"shard {path} does not match the manifest: sha256 {whole}, "
                                 f"manifest says {expected_sha256}")
    return tokens
