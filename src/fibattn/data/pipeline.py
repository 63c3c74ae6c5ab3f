"""``prepare``: sources -> tokenizer -> token shards + validation splits + ``manifest.json``.

Folder layout (``data_cfg.out_dir``)::

    tokenizer.json                  byte or bpe tokenizer (see tokenizers.py)
    train_<source>_<00000>.bin      training tokens of each source, shard_tokens per shard
    val_<source>.bin                held-out tail of each source's token stream
    manifest.json                   written last; its presence marks a complete folder

Each document is encoded and followed by the end-of-document token; a source's token
stream is its documents in order. Validation split: the last
``min(ceil(val_fraction * N), val_tokens_max)`` tokens of the source's N-token stream
(deterministic, disjoint from training). The folder is built in a hidden staging folder
next to ``out_dir`` and renamed into place, so a folder with a manifest is complete.
Re-running with the same config reuses the folder; a different config is an error
unless ``force=True`` (which always rebuilds).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..config import ConfigError, DataConfig, SourceConfig, validate_data
from ..files import atomic_write_text
from .shards import FORMAT_VERSION, ShardError, dtype_for_vocab, open_shard, write_shard
from .sources import check_source, describe_source, iter_documents
from .tokenizers import TOKENIZER_FILE, ByteTokenizer, tokenizer_sha256, train_bpe

log = logging.getLogger("fibattn")
MANIFEST_FILE = "manifest.json"
BPE_TRAIN_CHARS = 1 << 28          # characters sampled (split by source weight) to train a BPE
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 23


# ------------------------------------------------------------------------------ config
def normalise(data_cfg: DataConfig) -> DataConfig:
    """Copy of ``data_cfg`` with sources as SourceConfig (``--set data.sources=[{...}]`` gives dicts), validated."""
    cfg = dataclasses.replace(data_cfg)
    if not isinstance(cfg.sources, list):
        raise ConfigError(f"data.sources must be a list of sources, got {type(cfg.sources).__name__}")
    sources = []
    allowed = {f.name for f in dataclasses.fields(SourceConfig)}
    for i, src in enumerate(cfg.sources):
        if isinstance(src, dict):
            unknown = sorted(set(src) - allowed)
            if unknown:
                raise ConfigError(f"unknown key data.sources[{i}].{unknown[0]} (allowed: {', '.join(sorted(allowed))})")
            src = SourceConfig(**src)
        if not isinstance(src, SourceConfig):
            raise ConfigError(f"data.sources[{i}] must be a source mapping, got {type(src).__name__}")
        sources.append(dataclasses.replace(src))
    cfg.sources = sources
    validate_data(cfg)
    if cfg.tokenizer == "bpe" and cfg.vocab_size < 257:
        raise ConfigError(f"data.vocab_size must be >= 257 for tokenizer=bpe (256 bytes + eos), got {cfg.vocab_size}")
    for i, src in enumerate(cfg.sources):
        check_source(src, f"data.sources[{i}]")
    return cfg


def config_record(cfg: DataConfig) -> dict:
    """The part of the config a prepared folder depends on (``out_dir`` excluded)."""
    rec = dataclasses.asdict(cfg)
    rec.pop("out_dir")
    return rec


def read_manifest(folder) -> dict:
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a prepared data folder: no {MANIFEST_FILE} "
                                f"(run `fibattn prepare`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {manifest.get('format_version')!r}; "
                         f"this fibattn reads {FORMAT_VERSION} (prepare the data again with --force)")
    return manifest


def _differences(old, new, where="data") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{where}.{key}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def _expected_identity(cfg: DataConfig) -> dict:
    return {"config": config_record(cfg),
            "source_info": [describe_source(s, f"data.sources[{i}]") for i, s in enumerate(cfg.sources)]}


def _check_replaceable(out: Path) -> None:
    """Only a prepared folder (with a manifest) or an empty one is ever replaced, even with --force."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"data.out_dir {str(out)!r} exists and is not a folder")
    if not (out / MANIFEST_FILE).is_file() and any(out.iterdir()):
        raise ConfigError(f"data.out_dir {str(out)!r} exists, is not empty and is not a prepared data folder "
                          f"(no {MANIFEST_FILE}); remove it yourself or choose another --out")


def _check_existing(out: Path, cfg: DataConfig) -> bool:
    """True when ``out`` holds a prepared folder matching ``cfg``; False when absent or empty."""
    _check_replaceable(out)
    if not out.exists() or not (out / MANIFEST_FILE).is_file():
        return False
    manifest = read_manifest(out)
    old = {"config": manifest.get("config"), "source_info": [s.get("info") for s in manifest.get("sources", [])]}
    new = _expected_identity(cfg)
    diffs = _differences(old["config"], new["config"], "data") + \
        _differences(old["source_info"], new["source_info"], "sources")
    if not diffs:
        return True
    raise ConfigError(f"data.out_dir {str(out)!r} was prepared with a different config "
                      f"({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}); "
                      f"use --force to rebuild it or choose another --out")


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
class _ShardSink:
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


class _SourceWriter:
    """Streams one source: everything but a held-back tail goes to shards; the tail is split at the end."""

    def __init__(self, folder: Path, name: str, dtype, cfg: DataConfig):
        self.folder, self.name, self.dtype, self.cfg = folder, name, dtype, cfg
        self.sink = _ShardSink(folder, f"train_{name}", dtype, cfg.shard_tokens)
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

    def finish(self, where: str) -> dict:
        n_val = min(math.ceil(self.cfg.val_fraction * self.total), self.cfg.val_tokens_max)
        if self.total == 0:
            raise ValueError(f"{where} ({self.name}) produced no tokens: the source is empty")
        if self.total - n_val < 1:
            raise ValueError(f"{where} ({self.name}) has only {self.total} tokens, too few to hold out a "
                             f"validation split and still train")
        flat = np.concatenate(self.tail) if self.tail else np.zeros(0, self.dtype)
        self.sink.add(flat[:flat.size - n_val])
        self.sink.close()
        val = write_shard(self.folder / f"val_{self.name}.bin", flat[flat.size - n_val:], self.dtype)
        return {"tokens": self.total, "train_tokens": self.total - n_val, "val_tokens": n_val,
                "shards": self.sink.shards, "val": val}


def _batches(docs):
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _tokenise_source(src, where, tok, dtype, folder, cfg, progress) -> dict:
    writer = _SourceWriter(folder, src.name, dtype, cfg)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    docs = 0
    progress.begin()
    for batch in _batches(iter_documents(src, where)):
        encoded = tok.encode_batch(batch)
        writer.add(np.concatenate([part for ids in encoded for part in (ids.astype(dtype, copy=False), eos)]))
        docs += len(batch)
        progress.update(src.name, docs, writer.total)
    progress.update(src.name, docs, writer.total, final=True)
    info = writer.finish(where)
    info["docs"] = docs
    return info


def _bpe_sample(cfg: DataConfig, used: dict):
    """Documents to train the BPE on: up to BPE_TRAIN_CHARS characters, split by source weight.

    Fills ``used`` with the characters taken from each source."""
    total_w = sum(s.weight for s in cfg.sources)
    for i, src in enumerate(cfg.sources):
        budget, n = int(BPE_TRAIN_CHARS * src.weight / total_w), 0
        for doc in iter_documents(src, f"data.sources[{i}]"):
            if n >= budget:
                break
            yield doc[:budget - n]
            n += min(len(doc), budget - n)
        used[src.name] = n


def _make_tokenizer(cfg: DataConfig, folder: Path, progress: Progress) -> dict:
    t0 = time.perf_counter()
    if cfg.tokenizer == "byte":
        tok, extra = ByteTokenizer(), {}
    else:
        used: dict = {}
        tok = train_bpe(_bpe_sample(cfg, used), cfg.vocab_size)
        extra = {"requested_vocab_size": cfg.vocab_size, "trained_on_chars": used}
        if progress.enabled:
            progress.stream.write(f"prepare: trained bpe vocab={tok.vocab_size} on "
                                  f"{sum(used.values())} chars in {time.perf_counter() - t0:.1f}s\n")
    tok.save(folder / TOKENIZER_FILE)
    return {"tok": tok, "record": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                                   "file": TOKENIZER_FILE, "sha256": tokenizer_sha256(folder), **extra}}


def _build(cfg: DataConfig, folder: Path, progress: Progress) -> dict:
    made = _make_tokenizer(cfg, folder, progress)
    tok = made["tok"]
    dtype = dtype_for_vocab(tok.vocab_size)
    sources = []
    for i, src in enumerate(cfg.sources):
        where = f"data.sources[{i}]"
        info = _tokenise_source(src, where, tok, dtype, folder, cfg, progress)
        sources.append({"name": src.name, "kind": src.kind, "weight": src.weight,
                        "info": describe_source(src, where), **info})
    from .. import __version__
    return {"format_version": FORMAT_VERSION, "fibattn_version": __version__, "config": config_record(cfg),
            "tokenizer": made["record"], "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "dtype": dtype.name, "sources": sources,
            "validation": {s["name"]: s["val"]["file"] for s in sources},
            "train_tokens": sum(s["train_tokens"] for s in sources)}


def _install(staging: Path, out: Path, cfg: DataConfig, force: bool) -> None:
    """Rename ``staging`` to ``out``. With ``force`` an existing ``out`` is replaced; without, a
    matching folder that a concurrent prepare installed meanwhile is kept (and ours dropped)."""
    if force and out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old)
        return
    try:
        os.replace(staging, out)            # fails if out appeared meanwhile and is not empty
    except OSError:
        if not _check_existing(out, cfg):
            raise
        shutil.rmtree(staging)


def prepare(data_cfg: DataConfig, *, progress: bool = True, force: bool = False) -> Path:
    """Prepare ``data_cfg.out_dir``; returns the folder.

    An existing folder whose manifest matches the config is reused; a mismatching or foreign
    one is a ConfigError. ``force=True`` rebuilds and replaces it whatever it holds."""
    cfg = normalise(data_cfg)
    out = Path(cfg.out_dir).expanduser()
    if force:
        _check_replaceable(out)
    elif _check_existing(out, cfg):
        log.info("data: reusing %s (manifest matches the config)", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        manifest = _build(cfg, staging, Progress(progress))
        atomic_write_text(staging / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _install(staging, out, cfg, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def ensure_prepared(data_cfg: DataConfig, *, progress: bool = True) -> Path:
    """The prepared folder for ``data_cfg``: reused when it matches, built when absent, error otherwise."""
    return prepare(data_cfg, progress=progress, force=False)


def verify_prepared(folder) -> dict:
    """Re-hash every file of a prepared folder against its headers and manifest; returns a summary."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    tok = manifest["tokenizer"]
    tok_path = folder / tok["file"]
    if not tok_path.is_file() or tokenizer_sha256(tok_path) != tok["sha256"]:
        raise ShardError(f"tokenizer {tok_path} is missing or does not match the manifest sha256")
    files = tokens = 0
    for src in manifest["sources"]:
        for rec in src["shards"] + [src["val"]]:
            path = folder / rec["file"]
            arr = open_shard(path, verify=True, expected_sha256=rec["sha256"])
            if arr.size != rec["tokens"]:
                raise ShardError(f"shard {path} holds {arr.size} tokens, the manifest says {rec['tokens']}")
            if arr.size and int(arr.max()) >= manifest["vocab_size"]:
                raise ShardError(f"shard {path} holds token id {int(arr.max())} >= vocab_size {manifest['vocab_size']}")
            files += 1
            tokens += arr.size
    return {"folder": str(folder), "files": files, "tokens": int(tokens)}
