"""Document sources: ``bundled`` | ``files`` | ``hf`` (see ``SourceConfig.kind``).

``iter_documents(src, where)`` yields the source's documents as strings, in a fixed order,
stopping after ``src.max_docs`` (0: all). Empty documents (and ``None`` fields) are skipped.

- ``bundled``: the packaged Shakespeare corpus, one document per text (42).
- ``files``: a file, or a folder searched recursively (sorted by relative path; which of its
  files it reads: :mod:`.selection`, by content, with ``include`` / ``exclude`` globs). A text
  file of any name is one document; a ``.jsonl`` line or a ``.parquet`` row is one document,
  its text in ``src.text_field``. Text is UTF-8 (a leading byte-order mark is allowed).
  Nothing is skipped silently: what a folder skips (hidden, binary, globs) is said, and a
  file that would be read but cannot be (permissions), a broken link or a subfolder that
  cannot be listed is an error naming it, before anything is written.
- ``hf``: ``datasets.load_dataset(path, subset or None, split=split, streaming=True)``,
  reading ``src.text_field`` of each row. ``path`` may be a hub id or a local folder laid
  out like a hub dataset (parquet / jsonl data files).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Iterable, Iterator

from ..checks import UsageError
from ..config import ConfigError, SourceConfig
from ..files import TextFileError, parse_json, utf8_text
from .corpus import corpus_texts
from .hub import check_reachable, offline_hint
from .selection import select_files, unreadable
from .tokenizers import require


def files_sources(paths, flag: str = "--files", include=(), exclude=()) -> list[SourceConfig]:
    """One ``files`` source per path (a text/.jsonl/.parquet file or a folder), named after it (letters,
    digits, - and _; made unique) and stored as an absolute path, so a run that uses the prepared folder
    can be evaluated from any working directory. ``include`` / ``exclude``: globs given to every folder."""
    sources, names = [], set()
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ConfigError(f"{flag} {raw}: no such file or folder")
        base = "".join(c if c.isalnum() or c in "-_" else "_" for c in (path.stem or path.resolve().name)) or "text"
        name, k = base, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        names.add(name)
        globs = dict(include=list(include), exclude=list(exclude)) if path.is_dir() else {}
        sources.append(SourceConfig(name=name, kind="files", path=str(path.resolve()), **globs))
    if not sources:
        raise ConfigError(f"{flag} needs at least one file or folder")
    if (include or exclude) and not any(s.include or s.exclude for s in sources):
        raise ConfigError(f"--include / --exclude choose what a folder contributes; {flag} names no folder "
                          f"(got {', '.join(map(str, paths))})")
    return sources


def _text_of(value, where: str):
    if value is None or isinstance(value, str):
        return value
    raise UsageError(f"{where} is a {type(value).__name__}, expected a string")


def list_files(src: SourceConfig, where: str) -> list[Path]:
    """The files a ``files`` source reads, in reading order (:func:`.selection.select_files`)."""
    return select_files(src, where).files


def _read_error(path: Path, exc: OSError) -> UsageError:
    return UsageError(f"{path} cannot be read ({exc.strerror or exc}); make it readable or remove it from the source")


def _decode(raw: bytes, path: Path, where: str) -> str:
    try:
        return utf8_text(raw)               # a byte-order mark is fine; UTF-16, binary data: named as such
    except TextFileError as exc:
        raise UsageError(f"{where} is not valid UTF-8 text: {exc}; fibattn reads UTF-8 text files only, convert "
                         f"it (e.g. iconv -t UTF-8)") from None


def _read_txt(path: Path) -> Iterator[str]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _read_error(path, exc) from None
    yield _decode(raw, path, str(path))


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with open(path, "rb") as fh:
            yield from enumerate(fh, 1)
    except OSError as exc:
        raise _read_error(path, exc) from None


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    for lineno, raw in _lines(path):
        line = _decode(raw, path, f"{path}:{lineno}")
        if not line.strip():
            continue
        try:
            row = parse_json(line)
        except TextFileError as exc:        # the cause (a trailing comma, single quotes, ...), not the symptom
            raise UsageError(f"{path}:{lineno} is not valid JSON: {exc}") from None
        if not isinstance(row, dict) or field not in row:
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise UsageError(f"{path}:{lineno} has no text_field {field!r} (has: {keys})")
        yield _text_of(row[field], f"{path}:{lineno} field {field!r}")


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    pq = require("pyarrow.parquet", f"reading {path}")
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except OSError as exc:
        raise _read_error(path, exc) from None
    except Exception as exc:             # pyarrow raises its own types for a file that is not parquet
        raise UsageError(f"{path} is not a readable parquet file: {' '.join(str(exc).split())}") from None
    if field not in names:
        raise UsageError(f"{path} has no text_field column {field!r} (has: {', '.join(names)})")
    try:
        for batch in pf.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                yield _text_of(value, f"{path} column {field!r}")
    except (UsageError, ImportError):         # ours, and a missing package; pyarrow's own ValueErrors are wrapped
        raise
    except Exception as exc:
        raise UsageError(f"{path} cannot be read as parquet: {' '.join(str(exc).split())}") from None


def _files_documents(src: SourceConfig, where: str) -> Iterator[tuple[str, str]]:
    for path in list_files(src, where):
        if path.suffix == ".jsonl":
            docs = _read_jsonl(path, src.text_field)
        elif path.suffix == ".parquet":
            docs = _read_parquet(path, src.text_field)
        else:                            # text of any name (selection decided it by content)
            docs = _read_txt(path)
        yield from ((str(path), doc) for doc in docs)


def _hf_documents(src: SourceConfig, where: str) -> Iterator[tuple[str, str]]:
    datasets = require("datasets", f"{where} (kind=hf)")
    check_reachable(src.path, where)          # no network: one line now, not a minute of retries
    try:
        ds = datasets.load_dataset(src.path, src.subset or None, split=src.split, streaming=True)
    except Exception as exc:  # the hub raises many types; name the source and keep the cause
        raise UsageError(f"{where}: cannot load Hugging Face dataset {src.path!r} (subset={src.subset or None!r}, "
                         f"split={src.split!r}): {exc}{offline_hint(src.path)}") from exc
    for i, row in enumerate(ds):
        if src.text_field not in row:
            raise UsageError(f"{where}: row {i} of {src.path!r} has no text_field {src.text_field!r} "
                             f"(has: {', '.join(sorted(row))})")
        yield f"{src.path} row {i}", _text_of(row[src.text_field], f"{where}: row {i} field {src.text_field!r}")


def _bundled_documents(src: SourceConfig, where: str) -> Iterator[tuple[str, str]]:
    yield from (("the bundled corpus", text) for text in corpus_texts())


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


def iter_documents(src: SourceConfig, where: str = "source", *, origin: bool = False) -> Iterator:
    """The non-empty documents of ``src`` in order, at most ``src.max_docs`` (0: all); with ``origin``, as
    ``(where it was read: the file, or the dataset's row, document)`` pairs."""
    check_source(src, where)
    docs: Iterable = (pair for pair in _READERS[src.kind](src, where) if pair[1])
    docs = itertools.islice(docs, src.max_docs) if src.max_docs else iter(docs)
    return docs if origin else (doc for _, doc in docs)


def describe_source(src: SourceConfig, where: str = "source", stamps: dict | None = None) -> dict:
    """What the manifest records about a source beyond its config; for ``files`` (and ``hf`` read from
    a local folder) the sha256 of its content (file names and digests), so a file changed in place at
    the same size is a different source.

    ``stamps``: file name -> stamp of an earlier hash (the manifest's ``stamps``), reused while a
    file's size, mtime, ctime and inode are unchanged; refilled with the stamps of this call."""
    info = {"name": src.name, "kind": src.kind}
    root = Path(src.path).expanduser() if src.path else None
    if src.kind == "files":
        files = list_files(src, where)
        info["files"] = [p.name if root.is_file() else p.relative_to(root).as_posix() for p in files]
        info["bytes"] = sum(p.stat().st_size for p in files)
        info["sha256"] = _content_sha256(root, files, where, stamps)
    elif src.kind == "hf" and root is not None and root.exists():      # a local dataset folder, not a hub id
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts))
        info["sha256"] = _content_sha256(root, files, where, stamps)
    elif src.kind == "bundled":
        from .corpus import ATTRIBUTION, CORPUS_SHA256
        info.update(corpus_sha256=CORPUS_SHA256, attribution=ATTRIBUTION)
    return info


def _content_sha256(root: Path, files: list[Path], where: str, stamps: dict | None) -> str:
    """One digest of ``files`` (their names under ``root`` and sha256s), hashed through the stamp cache."""
    from .verified import file_digest
    known, digests = dict(stamps or {}), []
    if stamps is not None:
        stamps.clear()
    for path in files:
        name = path.name if root.is_file() else path.relative_to(root).as_posix()
        try:
            digest, stamp = file_digest(path, known.get(name))
        except OSError as exc:
            raise unreadable(path, f"{where}.path", exc) from None
        digests.append([name, digest])
        if stamps is not None and stamp is not None:
            stamps[name] = stamp
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()
