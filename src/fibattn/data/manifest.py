"""``manifest.json`` of a prepared data folder: read and checked.

Every key fibattn reads must be there with the right type, and file names must be plain
names inside the folder; anything else is one ValueError naming the file and the key.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import numbers
import re
from pathlib import Path

from ..files import TextFileError, read_json
from ..checks import UsageError
from ..config import DataConfig, SourceConfig, from_dict
from .shards import FORMAT_VERSION

MANIFEST_FILE = "manifest.json"


def data_config(folder) -> tuple[DataConfig, dict]:
    """The :class:`~fibattn.config.DataConfig` a prepared folder was built with (its manifest's
    ``config``), with ``out_dir`` the folder's absolute path: what ``fibattn train --data DIR`` uses."""
    manifest = read_manifest(folder)
    rec = manifest.get("config")
    if not isinstance(rec, dict):
        raise UsageError(f"{Path(folder) / MANIFEST_FILE} records no data config (prepared by an older fibattn?); "
                         f"prepare the folder again with --force")
    try:
        data = from_dict({"data": {**rec, "out_dir": str(Path(folder).resolve())}}).data
    except ValueError as exc:
        raise UsageError(f"{Path(folder) / MANIFEST_FILE}: its data config is not one this fibattn reads ({exc})") \
            from None
    return data, manifest


def recorded_config(manifest: dict):
    """The manifest's data config with the source keys added since it was written (include, exclude) at
    their defaults, so that a folder an older fibattn prepared compares equal and stays reusable."""
    rec = manifest.get("config")
    if not isinstance(rec, dict) or not isinstance(rec.get("sources"), list):
        return rec
    defaults = dataclasses.asdict(SourceConfig())
    return {**rec, "sources": [{**defaults, **s} if isinstance(s, dict) else s for s in rec["sources"]]}


_HEX64 = re.compile(r"[0-9a-f]{64}")
_REBUILD = "prepare the data again with --force"


class _Bad(Exception):
    """One problem in a manifest: where (a key path) and what is wrong."""


def _need_type(value, where: str, kind: str):
    ok = {
        "int": isinstance(value, numbers.Integral) and not isinstance(value, bool),
        "number": isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value),
        "str": isinstance(value, str) and value != "",
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        wanted = {"int": "an integer", "number": "a finite number", "str": "a non-empty string",
                  "dict": "a mapping", "list": "a list"}[kind]
        raise _Bad(f"{where} must be {wanted}, got {value!r}"[:300])
    return value


def _get(obj: dict, key: str, where: str, kind: str, minimum=None):
    if key not in obj:
        raise _Bad(f"{where}{key} is missing")
    value = _need_type(obj[key], f"{where}{key}", kind)
    if minimum is not None and value < minimum:
        raise _Bad(f"{where}{key} must be >= {minimum}, got {value!r}")
    return value


def _file_name(value, where: str) -> str:
    _need_type(value, where, "str")
    if value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        raise _Bad(f"{where} must be a plain file name inside the folder, got {value!r}")
    return value


def _record(rec, where: str, minimum_tokens: int = 0) -> None:
    _need_type(rec, where, "dict")
    _file_name(_get(rec, "file", f"{where}.", "str"), f"{where}.file")
    _get(rec, "tokens", f"{where}.", "int", minimum_tokens)
    digest = _get(rec, "sha256", f"{where}.", "str")
    if not _HEX64.fullmatch(digest):
        raise _Bad(f"{where}.sha256 must be 64 lowercase hex digits, got {digest!r}"[:300])
    if "bytes" in rec:
        _get(rec, "bytes", f"{where}.", "int", 0)


def check_manifest(manifest, path) -> dict:
    """Every key fibattn reads, with its type; a ValueError naming ``path`` and the key otherwise."""
    try:
        _need_type(manifest, "the document", "dict")
        vocab = _get(manifest, "vocab_size", "", "int", 1)
        eos = _get(manifest, "eos_id", "", "int", 0)
        if eos >= vocab:
            raise _Bad(f"eos_id must be < vocab_size ({vocab}), got {eos}")
        dtype = _get(manifest, "dtype", "", "str")
        if dtype not in ("uint16", "uint32"):
            raise _Bad(f"dtype must be uint16 or uint32, got {dtype!r}")
        _get(manifest, "train_tokens", "", "int", 0)
        tok = _get(manifest, "tokenizer", "", "dict")
        _get(tok, "name", "tokenizer.", "str")
        _file_name(_get(tok, "file", "tokenizer.", "str"), "tokenizer.file")
        if not _HEX64.fullmatch(_get(tok, "sha256", "tokenizer.", "str")):
            raise _Bad(f"tokenizer.sha256 must be 64 lowercase hex digits, got {tok['sha256']!r}"[:300])
        if "config" in manifest:
            _need_type(manifest["config"], "config", "dict")
        sources = _get(manifest, "sources", "", "list")
        if not sources:
            raise _Bad("sources must list at least one source, got []")
        names, files = set(), {tok["file"]}
        for i, src in enumerate(sources):
            where = f"sources[{i}]"
            _need_type(src, where, "dict")
            name = _get(src, "name", f"{where}.", "str")
            if name in names:
                raise _Bad(f"{where}.name {name!r} is used twice")
            names.add(name)
            weight = _get(src, "weight", f"{where}.", "number")
            if weight <= 0:
                raise _Bad(f"{where}.weight must be > 0, got {weight!r}")
            for key in ("docs", "tokens", "train_tokens", "val_tokens"):
                _get(src, key, f"{where}.", "int", 0)
            for j, rec in enumerate(_get(src, "shards", f"{where}.", "list")):
                _record(rec, f"{where}.shards[{j}]")
            if "val" not in src:
                raise _Bad(f"{where}.val is missing")
            _record(src["val"], f"{where}.val", minimum_tokens=1)
            for rec in src["shards"] + [src["val"]]:
                if rec["file"] in files:
                    raise _Bad(f"file {rec['file']!r} is listed twice")
                files.add(rec["file"])
            if "info" in src and not isinstance(src["info"], dict):
                raise _Bad(f"{where}.info must be a mapping, got {src['info']!r}"[:300])
    except _Bad as exc:
        raise UsageError(f"{path} is not a valid fibattn manifest: {exc} ({_REBUILD})") from None
    return manifest


def read_manifest(folder) -> dict:
    """The checked manifest of a prepared folder (see :func:`check_manifest`); errors name the file."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        if Path(folder).is_file():
            raise NotADirectoryError(f"{folder} is a file, not a prepared data folder (run `fibattn prepare`)")
        model = (Path(folder) / "config.json").is_file() or (Path(folder) / "checkpoints").is_dir()
        # errno + filename: the CLI's one line then names the flag or setting the folder came from
        raise FileNotFoundError(errno.ENOENT, f"not a prepared data folder, no {MANIFEST_FILE}" + (
            "; it holds a model, a run or an export: give the data folder it was trained on, or prepare one with "
            "`fibattn prepare`" if model else "; run `fibattn prepare`"), str(folder))
    try:
        manifest = read_json(path)
    except OSError as exc:
        raise UsageError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except TextFileError as exc:           # the cause: UTF-16, a byte-order mark is fine, a trailing comma, ...
        raise UsageError(f"{path} is not a valid fibattn manifest: {exc} ({_REBUILD})") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"{path} is not a valid fibattn manifest: the document must be a JSON object, got "
                         f"{type(manifest).__name__} ({_REBUILD})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path} has format_version {manifest.get('format_version')!r}; "
                         f"this fibattn reads {FORMAT_VERSION} (prepare the data again with --force)")
    return check_manifest(manifest, path)
