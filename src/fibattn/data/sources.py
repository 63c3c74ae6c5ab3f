"""Document sources: ``bundled`` | ``files`` | ``hf`` (see ``SourceConfig.kind``).

``iter_documents(src, where)`` yields the source's documents as strings, in a fixed order,
stopping after ``src.max_docs`` (0: all). Empty documents (and ``None`` fields) are skipped.

- ``bundled``: the packaged Shakespeare corpus, one document per text (42).
- ``files``: a ``.txt`` / ``.jsonl`` / ``.parquet`` file, or a folder searched recursively
  for them (sorted by relative path). A ``.txt`` file is one document; a ``.jsonl`` line or
  a ``.parquet`` row is one document, its text in ``src.text_field``.
- ``hf``: ``datasets.load_dataset(path, subset or None, split=split, streaming=True)``,
  reading ``src.text_field`` of each row. ``path`` may be a hub id or a local folder laid
  out like a hub dataset (parquet / jsonl data files).
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterable, Iterator

from ..config import ConfigError, SourceConfig
from .corpus import corpus_texts
from .tokenizers import require

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")


def _text_of(value, where: str):
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{where} is a {type(value).__name__}, expected a string")


def list_files(src: SourceConfig, where: str) -> list[Path]:
    """The files a ``files`` source reads, in reading order."""
    root = Path(src.path).expanduser()
    if not root.exists():
        raise ConfigError(f"{where}.path {src.path!r} does not exist")
    if root.is_file():
        if root.suffix not in FILE_SUFFIXES:
            raise ConfigError(f"{where}.path {src.path!r} must end in one of {', '.join(FILE_SUFFIXES)}")
        return [root]
    files = sorted((p for p in root.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError(f"{where}.path {src.path!r} is a folder with no {', '.join(FILE_SUFFIXES)} files")
    return files


def _read_txt(path: Path) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid UTF-8 text: {exc}") from exc


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno} is not valid JSON: {exc}") from exc
            if not isinstance(row, dict) or field not in row:
                keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{lineno} has no text_field {field!r} (has: {keys})")
            yield _text_of(row[field], f"{path}:{lineno} field {field!r}")


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    pq = require("pyarrow.parquet", f"reading {path}")
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path} has no text_field column {field!r} (has: {', '.join(names)})")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield _text_of(value, f"{path} column {field!r}")


def _files_documents(src: SourceConfig, where: str) -> Iterator[str]:
    for path in list_files(src, where):
        if path.suffix == ".txt":
            yield from _read_txt(path)
        elif path.suffix == ".jsonl":
            yield from _read_jsonl(path, src.text_field)
        else:
            yield from _read_parquet(path, src.text_field)


def _hf_documents(src: SourceConfig, where: str) -> Iterator[str]:
    datasets = require("datasets", f"{where} (kind=hf)")
    try:
        ds = datasets.load_dataset(src.path, src.subset or None, split=src.split, streaming=True)
    except Exception as exc:  # the hub raises many types; name the source and keep the cause
        raise ValueError(f"{where}: cannot load Hugging Face dataset {src.path!r} "
                         f"(subset={src.subset or None!r}, split={src.split!r}): {exc}") from exc
    for i, row in enumerate(ds):
        if src.text_field not in row:
            raise ValueError(f"{where}: row {i} of {src.path!r} has no text_field {src.text_field!r} "
                             f"(has: {', '.join(sorted(row))})")
        yield _text_of(row[src.text_field], f"{where}: row {i} field {src.text_field!r}")


def _bundled_documents(src: SourceConfig, where: str) -> Iterator[str]:
    yield from corpus_texts()


_READERS = {"bundled": _bundled_documents, "files": _files_documents, "hf": _hf_documents}


def check_source(src: SourceConfig, where: str) -> None:
    """Cheap checks before any reading: kind known, path present where needed."""
    if src.kind not in _READERS:
        raise ConfigError(f"{where}.kind must be one of {', '.join(_READERS)}, got {src.kind!r}")
    if src.kind == "files":
        list_files(src, where)
    elif src.kind == "bundled" and src.path:
        raise ConfigError(f"{where}.path must be empty for kind=bundled (use kind=files for a local path), "
                          f"got {src.path!r}")


def iter_documents(src: SourceConfig, where: str = "source") -> Iterator[str]:
    """The non-empty documents of ``src`` in order, at most ``src.max_docs`` (0: all)."""
    check_source(src, where)
    docs: Iterable = (d for d in _READERS[src.kind](src, where) if d)
    return itertools.islice(docs, src.max_docs) if src.max_docs else iter(docs)


def describe_source(src: SourceConfig, where: str = "source") -> dict:
    """What the manifest records about a source beyond its config."""
    info = {"name": src.name, "kind": src.kind}
    if src.kind == "files":
        root = Path(src.path).expanduser()
        files = list_files(src, where)
        info["files"] = [p.name if root.is_file() else p.relative_to(root).as_posix() for p in files]
        info["bytes"] = sum(p.stat().st_size for p in files)
    elif src.kind == "bundled":
        from .corpus import ATTRIBUTION, CORPUS_SHA256
        info.update(corpus_sha256=CORPUS_SHA256, attribution=ATTRIBUTION)
    return info
