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

Interrupted runs. The staging folder is ``.<out name>.partial-<random>`` and holds the
marker file ``.fibattn-staging`` (naming the target, pid and host) that its prepare keeps
locked while it runs. A prepare killed outright (``kill -9``, power loss) cannot remove
it; the next prepare of the same ``out_dir`` removes every such folder whose marker names
this target and is no longer held (its process is gone), with a one-line notice each; a
``force`` rebuild moves the folder it replaces into such a marked folder too, so a kill
there is cleaned up the same way. (``.<out name>.old-<pid>`` folders left by earlier
versions are removed when their pid is gone and they hold only prepared-folder files.)
Folders without fibattn's marker are never touched.

A ``manifest.json`` is checked when read (:func:`read_manifest`): every key fibattn uses
must be there with the right type, and file names must be plain names inside the folder.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

from ..checks import did_you_mean
from ..config import ConfigError, DataConfig, SourceConfig
from ..files import atomic_write_text, check_creatable, fsync_dir, mark_ignored, naming_os_errors
from ..locks import FolderLock, check_unlocked, drop_stale
from ..validation import validate_data
from .manifest import MANIFEST_FILE, read_manifest, recorded_config
from .shards import FORMAT_VERSION, ShardError, dtype_for_vocab
from .selection import skipped_note
from .sources import check_source, describe_source, iter_documents
from .staging import Staging, clean_leftovers
from .tokenizers import TOKENIZER_FILE, ByteTokenizer, DocumentTooLong, tokenizer_sha256, train_bpe
from .verified import verified_shard
from .writing import Progress, SourceWriter

log = logging.getLogger("fibattn")
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
                raise ConfigError(f"unknown key data.sources[{i}].{unknown[0]} (allowed: {', '.join(sorted(allowed))})"
                                  f"{did_you_mean(unknown[0], allowed)}")
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


def _differences(old, new, where="data") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{where}.{key}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def _expected_identity(cfg: DataConfig, stamps: list[dict] | None = None) -> dict:
    """The config and each source's description (its content digest included). ``stamps``: per source,
    the stamps of earlier hashes (reused for unchanged files, refilled)."""
    stamps = stamps if stamps is not None else [{} for _ in cfg.sources]
    return {"config": config_record(cfg),
            "source_info": [describe_source(s, f"data.sources[{i}]", stamps[i]) for i, s in enumerate(cfg.sources)]}


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
    old = {"config": recorded_config(manifest),
           "source_info": [s.get("info") for s in manifest.get("sources", [])]}
    known = [s.get("stamps") if isinstance(s.get("stamps"), dict) else {} for s in manifest["sources"]]
    new = _expected_identity(cfg, (known + [{} for _ in cfg.sources])[:len(cfg.sources)])
    diffs = _differences(old["config"], new["config"], "data") + \
        [_content_change(d, cfg) for d in _differences(old["source_info"], new["source_info"], "sources")]
    if cfg.tokenizer not in ("byte", "bpe"):           # a reused tokenizer file: decided by its content too
        try:
            now = tokenizer_sha256(Path(cfg.tokenizer).expanduser())
        except OSError:
            now = None
        diffs += _differences((manifest.get("tokenizer") or {}).get("source_sha256"), now,
                              "data.tokenizer (sha256 of the file)")
    if not diffs:
        return True
    raise ConfigError(f"data.out_dir {str(out)!r} was prepared with a different config "
                      f"({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}); "
                      f"rebuild it (fibattn prepare --force), choose another data.out_dir, or train on it as "
                      f"prepared (fibattn train --data {out})")


def _content_change(diff: str, cfg: DataConfig) -> str:
    """``sources[i].sha256: ...`` said as what the user controls: the source's path whose content changed."""
    m = re.match(r"sources\[(\d+)\]\.sha256: (.*)", diff)
    if not m or int(m.group(1)) >= len(cfg.sources):
        return diff
    i = int(m.group(1))
    return f"the content of data.sources[{i}] {cfg.sources[i].path} changed (sha256 {m.group(2)})"


def _batches(docs):
    """``(origin, document)`` pairs in batches of a bounded size."""
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc[1])
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _tokenise_source(src, where, tok, dtype, folder, cfg, progress) -> dict:
    writer = SourceWriter(folder, src.name, dtype, cfg)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    docs = 0
    progress.begin()
    for batch in _batches(iter_documents(src, where, origin=True)):
        try:
            encoded = tok.encode_batch([doc for _, doc in batch])
        except DocumentTooLong as exc:          # named here, where the document's file is known
            raise ConfigError(f"{where} {batch[exc.index][0]}: {exc}") from None
        writer.add(np.concatenate([part for ids in encoded for part in (ids.astype(dtype, copy=False), eos)]))
        docs += len(batch)
        progress.update(src.name, docs, writer.total)
    progress.update(src.name, docs, writer.total, final=True)
    info = writer.finish(where, src.path)
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
    elif cfg.tokenizer != "bpe":                 # a pretrained tokenizer, copied into the folder as it is
        from .tokenizers import load_tokenizer
        f = Path(cfg.tokenizer).expanduser()
        if not (f.is_file() or (f / TOKENIZER_FILE).is_file()):
            raise ConfigError(f"data.tokenizer must be byte, bpe, or a tokenizer.json file (or a folder holding one) "
                              f"to reuse; {f} is neither")
        tok = load_tokenizer(f)
        extra = {"source": str(Path(cfg.tokenizer).expanduser().absolute()),
                 "source_sha256": tokenizer_sha256(Path(cfg.tokenizer).expanduser())}
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
    stamps = [{} for _ in cfg.sources]
    before = _expected_identity(cfg, stamps)["source_info"]
    made = _make_tokenizer(cfg, folder, progress)
    tok = made["tok"]
    dtype = dtype_for_vocab(tok.vocab_size)
    sources = []
    for i, src in enumerate(cfg.sources):
        where = f"data.sources[{i}]"
        info = _tokenise_source(src, where, tok, dtype, folder, cfg, progress)
        sources.append({"name": src.name, "kind": src.kind, "weight": src.weight, "info": before[i],
                        "stamps": stamps[i], **info})
    after = _expected_identity(cfg, stamps)["source_info"]     # unchanged files are not hashed again
    for i, (a, b) in enumerate(zip(before, after)):
        if a != b:
            raise ConfigError(f"data.sources[{i}] ({cfg.sources[i].path}) changed while it was being prepared; "
                              f"run prepare again once nothing writes to it")
    from .. import __version__
    return {"format_version": FORMAT_VERSION, "fibattn_version": __version__, "config": config_record(cfg),
            "tokenizer": made["record"], "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "dtype": dtype.name, "sources": sources,
            "validation": {s["name"]: s["val"]["file"] for s in sources},
            "train_tokens": sum(s["train_tokens"] for s in sources)}


def _install(staging: Path, out: Path, cfg: DataConfig, force: bool) -> None:
    """Rename ``staging`` to ``out``. With ``force`` an existing ``out`` is replaced; without, a
    matching folder that a concurrent prepare installed meanwhile is kept (and ours dropped). The folder's
    entries are synced before the rename and its new parent after, as a checkpoint's are."""
    fsync_dir(staging)
    if force and out.exists():
        trash = Staging(out)               # marked and locked: a kill below leaves a folder the next run removes
        try:
            os.replace(out, trash.path / "old")
            try:
                os.replace(staging, out)
            except BaseException:
                os.replace(trash.path / "old", out)         # never leave out_dir missing
                raise
            fsync_dir(out.parent)
            shutil.rmtree(trash.path / "old")
        finally:
            shutil.rmtree(trash.path, ignore_errors=True)
            trash.close()
        return
    try:
        os.replace(staging, out)            # fails if out appeared meanwhile and is not empty
    except OSError:
        if not _check_existing(out, cfg):
            raise
        shutil.rmtree(staging)
        return
    fsync_dir(out.parent)


def prepare(data_cfg: DataConfig, *, progress: bool = True, force: bool = False) -> Path:
    """Prepare ``data_cfg.out_dir``; returns the folder.

    An existing folder whose manifest matches the config is reused; a mismatching or foreign
    one is a ConfigError. ``force=True`` rebuilds and replaces it whatever it holds."""
    cfg = normalise(data_cfg)
    for i, src in enumerate(cfg.sources):             # what a folder leaves out is said, never dropped silently
        note = skipped_note(src, f"data.sources[{i}]")
        if note:
            log.info("%s", note)
    if not isinstance(cfg.out_dir, (str, os.PathLike)) or not str(cfg.out_dir).strip():
        raise ConfigError(f"data.out_dir must name a folder to create or reuse, got {cfg.out_dir!r}")
    out = Path(cfg.out_dir).expanduser()
    _check_out_path(out)
    check_unlocked(lock_path(out), out, "data.out_dir")     # another prepare of it runs: refuse, write nothing
    clean_leftovers(out)
    drop_stale(lock_path(out))
    if force:
        _check_replaceable(out)
    elif _check_existing(out, cfg):
        log.info("data: reusing %s (manifest matches the config)", out)
        return out
    made = _make_parents(out.parent)
    staging = lock = None
    try:
        with naming_os_errors(out, "data.out_dir"):
            lock = FolderLock(lock_path(out), out, "data.out_dir", "fibattn prepare").acquire()
            if not force and _check_existing(out, cfg):     # a prepare that held the lock made it meanwhile
                return out
            staging = Staging(out)
            manifest = _build(cfg, staging.path, Progress(progress))
            atomic_write_text(staging.path / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            staging.unmark()
            _install(staging.path, out, cfg, force)
        mark_ignored(made)               # a data/ this call created: not for version control
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging.path, ignore_errors=True)
        if lock is not None:
            lock.release()
        for folder in made:              # parents this call created, innermost first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        if staging is not None:
            staging.close()
        if lock is not None:
            lock.release()
    return out


def lock_path(out: Path) -> Path:
    """The lock file of a data folder being prepared: next to it, since the folder itself is replaced."""
    return out.parent / f".{out.name}.fibattn-lock"


def _check_out_path(out: Path) -> None:
    """``out_dir`` must be creatable: no existing file on its path."""
    if out.name in ("", ".", ".."):
        raise ConfigError(f"data.out_dir must name a folder to create or reuse (not '', '.', '..' or '/'), "
                          f"got {str(out)!r}")
    check_creatable(out, "data.out_dir")


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and missing parents; returns the ones created, innermost first."""
    missing = []
    for p in [folder, *folder.parents]:
        if p.exists():
            break
        missing.append(p)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data.out_dir: cannot create the folder {folder}: {exc.strerror or exc}; "
                          f"choose another --out") from None
    return missing


def ensure_prepared(data_cfg: DataConfig, *, progress: bool = True) -> Path:
    """The prepared folder for ``data_cfg``: reused when it matches, built when absent, error otherwise."""
    return prepare(data_cfg, progress=progress, force=False)


def verify_prepared(folder) -> dict:
    """Re-hash every file of a prepared folder against its headers and manifest; returns a summary."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    tok = manifest["tokenizer"]
    tok_path = folder / tok["file"]
    try:
        same = tok_path.is_file() and tokenizer_sha256(tok_path) == tok["sha256"]
    except OSError as exc:
        raise ShardError(f"tokenizer {tok_path} cannot be read: {exc.strerror or exc}") from None
    if not same:
        raise ShardError(f"tokenizer {tok_path} is missing or does not match the manifest sha256")
    files = tokens = 0
    for src in manifest["sources"]:
        for rec in src["shards"] + [src["val"]]:
            # every file is hashed now (force); the check is remembered for the validation reads
            arr = verified_shard(folder, rec, manifest["vocab_size"], force=True)
            files += 1
            tokens += arr.size
    return {"folder": str(folder), "files": files, "tokens": int(tokens)}
