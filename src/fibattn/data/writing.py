"""Writing a prepared folder's token streams: shards of ``shard_tokens``, the validation tail
held back per source, and the ``prepare:`` progress line."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

from ..checks import UsageError
from ..config import DataConfig
from .shards import write_shard


# ---------------------------------------------------------------------------- progress
class Progress:
    """One greppable ``prepare:`` line every few seconds (or a live line on a TTY)."""

    def __init__(self, enabled: bool, stream=None, every_s: float = 2.0):
        self.enabled, self.stream, self.every_s = enabled, stream or sys.stderr, every_s
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.shown = None

    def begin(self):
        self.start = self.last = time.perf_counter()
        self.shown = None

    def _line(self, name, docs, tokens):
        el = max(time.perf_counter() - self.start, 1e-9)
        return f"prepare: source={name} docs={docs} tokens={tokens} tok/s={tokens / el:.3g} elapsed={el:.1f}s"

    def update(self, name, docs, tokens, final=False):
        if not self.enabled:
            return
        now = time.perf_counter()
        if (not final and now - self.last < (0.2 if self.tty else self.every_s)) or \
                (final and not self.tty and self.shown == (name, docs, tokens)):
            return
        self.last, self.shown = now, (name, docs, tokens)
        line = self._line(name, docs, tokens)
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# ------------------------------------------------------------------------------ writing
class ShardSink:
    """Cuts a token stream into shards of ``shard_tokens``."""

    def __init__(self, folder: Path, stem: str, dtype, shard_tokens: int):
        self.folder, self.stem, self.dtype, self.size = folder, stem, dtype, shard_tokens
        self.buf: list[np.ndarray] = []
        self.n = 0
        self.shards: list[dict] = []

    def add(self, arr: np.ndarray):
        self.buf.append(arr)
        self.n += arr.size
        if self.n < self.size:
            return
        flat = np.concatenate(self.buf)
        full = flat.size // self.size * self.size
        for start in range(0, full, self.size):
            self._write(flat[start:start + self.size])
        rest = flat[full:]
        self.buf, self.n = ([rest] if rest.size else []), rest.size

    def _write(self, arr):
        path = self.folder / f"{self.stem}_{len(self.shards):05d}.bin"
        self.shards.append(write_shard(path, arr, self.dtype))

    def close(self):
        if self.n:
            self._write(np.concatenate(self.buf))
        self.buf, self.n = [], 0


class SourceWriter:
    """Streams one source: everything but a held-back tail goes to shards; the tail is split at the end."""

    def __init__(self, folder: Path, name: str, dtype, cfg: DataConfig):
        self.folder, self.name, self.dtype, self.cfg = folder, name, dtype, cfg
        self.sink = ShardSink(folder, f"train_{name}", dtype, cfg.shard_tokens)
        self.keep = cfg.val_tokens_max                  # the validation tail is never longer
        self.flush = max(self.keep, 1 << 20)
        self.tail: list[np.ndarray] = []
        self.tail_n = 0
        self.total = 0

    def add(self, arr: np.ndarray):
        self.tail.append(arr)
        self.tail_n += arr.size
        self.total += arr.size
        if self.tail_n >= self.keep + self.flush:
            flat = np.concatenate(self.tail)
            cut = flat.size - self.keep
            self.sink.add(flat[:cut])
            self.tail, self.tail_n = [flat[cut:]], self.keep

    def finish(self, where: str, path: str = "") -> dict:
        """``path``: the source's file or folder, named in the errors (the user gave it, not ``where``)."""
        n_val = min(math.ceil(self.cfg.val_fraction * self.total), self.cfg.val_tokens_max)
        given = f" ({path})" if path else ""
        if self.total == 0:
            raise UsageError(f"{where} ({self.name}) produced no tokens: the source{given} is empty")
        if self.total - n_val < 1:
            raise UsageError(f"{where} ({self.name}) has only {self.total} tokens, too few to hold out a "
                             f"validation split and still train; add text to{given or ' the source'}")
        flat = np.concatenate(self.tail) if self.tail else np.zeros(0, self.dtype)
        self.sink.add(flat[:flat.size - n_val])
        self.sink.close()
        val = write_shard(self.folder / f"val_{self.name}.bin", flat[flat.size - n_val:], self.dtype)
        return {"tokens": self.total, "train_tokens": self.total - n_val, "val_tokens": n_val,
                "shards": self.sink.shards, "val": val}
