"""Checkpoints as safetensors + JSON folders, never pickle.

Layout of ``OUT/checkpoints/step-N/``::

    model.safetensors            the model's state_dict (plain keys, loadable by anyone)
    <part>.json [+ <part>.safetensors]
                                 any other state (optimizer, RNG, data loader, trainer)
                                 through a small codec: tensors and numpy arrays go to the
                                 safetensors file and are referenced from the JSON
    meta.json                    written last: format, step and the sha256 + size of every
                                 other file; its presence marks the checkpoint complete

A checkpoint is written into ``step-N.tmp`` and renamed to ``step-N`` once ``meta.json``
is in place, so a crash never leaves a folder that looks complete. :func:`verify` checks
every listed file's size and hash and names the first bad one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..checks import UsageError
from ..files import atomic_write_bytes, atomic_write_text, fsync_dir, listed_file_problem, read_json, sha256_file
from ..locks import try_flock
from .pins import META, pin, unpin

log = logging.getLogger("fibattn")

FORMAT = 1
MODEL = "model.safetensors"
CONFIG = "config.json"
_NAME = re.compile(r"^step-(\d+)$")
# model settings that may differ between a checkpoint and its run's config.json (the weights do not depend on them)
RUNTIME_MODEL_KEYS = ("backend", "reach", "max_seq_len")


class CheckpointError(UsageError):
    """A checkpoint is incomplete or corrupted; the message names the folder and file."""


# ----------------------------------------------------------------------------- codec
def _encode(obj: Any, tensors: dict, path: str):
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").clone().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": path}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        if all(isinstance(k, (str, int)) for k in obj):
            return {"__items__": [[k, _encode(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    raise TypeError(f"cannot store {type(obj).__name__} at {path or 'top level'} in a checkpoint "
                    f"(allowed: tensors, numpy arrays, numbers, strings, lists, tuples, dicts)")


def _decode(obj: Any, tensors: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def encode_state(obj: Any) -> tuple[bytes, bytes | None]:
    """``(json bytes, safetensors bytes or None)`` for a nested state object."""
    tensors: dict = {}
    doc = _encode(obj, tensors, "")
    text = json.dumps({"format": FORMAT, "state": doc}, indent=1, sort_keys=True) + "\n"
    return text.encode(), (st_save(tensors) if tensors else None)


def decode_state(json_bytes: bytes, tensor_bytes: bytes | None) -> Any:
    doc = json.loads(json_bytes)
    tensors = st_load(tensor_bytes) if tensor_bytes else {}
    return _decode(doc["state"], tensors)


# ----------------------------------------------------------------------------- writing
def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step}"


def begin(root, step: int) -> Path:
    """Create a fresh ``step-N.tmp`` folder (removing a stale one) and return it."""
    tmp = Path(root) / f"step-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_tensors(folder, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """``folder/name.safetensors`` from a flat dict of tensors (copied to CPU, contiguous)."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write_bytes(Path(folder) / f"{name}.safetensors", st_save(flat))


def write_state(folder, name: str, obj: Any) -> None:
    """``folder/name.json`` (+ ``name.safetensors`` when the object holds tensors)."""
    js, st = encode_state(obj)
    if st is not None:
        atomic_write_bytes(Path(folder) / f"{name}.safetensors", st)
    atomic_write_bytes(Path(folder) / f"{name}.json", js)


def finish(root, step: int, extra_meta: dict | None = None) -> Path:
    """Hash every file of ``step-N.tmp``, write ``meta.json`` last, rename to ``step-N``."""
    tmp = Path(root) / f"step-{step}.tmp"
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(tmp.iterdir()) if p.is_file() and p.name != META and not p.name.startswith(".")}
    meta = {"format": FORMAT, "step": step, "files": files, **(extra_meta or {})}
    atomic_write_text(tmp / META, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    fsync_dir(tmp)
    final = step_dir(root, step)
    if final.exists():
        set_aside(final)
    tmp.rename(final)
    fsync_dir(root)
    return final


def set_aside(path) -> Path:
    """Rename a ``step-N`` folder that is in the way of a new save to ``step-N.set-aside[-K]`` (never deleted,
    never listed as a checkpoint, never pruned); returns the new path."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.set-aside")
    k = 1
    while aside.exists():
        k += 1
        aside = path.with_name(f"{path.name}.set-aside-{k}")
    path.rename(aside)
    log.warning("fibattn: %s was in the way of a new checkpoint of the same step; moved to %s (not deleted)",
                path, aside.name)
    return aside


def prune(root, keep: int, upto: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` ``step-N`` folders; returns the deleted ones.

    ``upto``: the step just saved; only folders of that step or older are counted and deleted, so
    a checkpoint newer than the one just written is never pruned (and never makes it prune the new one).
    A checkpoint a reader has pinned (:func:`pin`) is kept; a later prune deletes it once it is free.
    """
    found = [(s, p) for s, p in list_checkpoints(root) if upto is None or s <= upto]
    gone = []
    for path in [path for _, path in found[:-keep]] if keep > 0 else []:
        unpin(path)                                 # this process's own earlier read of it is over
        try:
            fd = os.open(path / META, os.O_RDONLY)
        except OSError:
            fd = None                               # incomplete: no reader can have it pinned
        try:
            if fd is not None and try_flock(fd) is False:
                log.info("fibattn: keeping %s for now: a reader (eval, export, generate, --init-from) has it open",
                         path)
                continue
            shutil.rmtree(path, ignore_errors=True)     # while locked: a reader waiting for it then sees it gone
            gone.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return gone


def clean_tmp(root) -> None:
    """Remove ``step-N.tmp`` folders left by an interrupted save."""
    root = Path(root)
    if root.is_dir():
        for p in root.glob("step-*.tmp"):
            log.warning("fibattn: removing incomplete checkpoint folder %s", p)
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- reading
def list_checkpoints(root) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N`` folder, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(out)


def _is_plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def _meta_problem(meta) -> str | None:
    """What is wrong with the shape of a parsed ``meta.json`` (None when it is well formed)."""
    if not isinstance(meta, dict):
        return f"is not a JSON object (got {type(meta).__name__})"
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"field 'step' must be an integer >= 0, got {step!r}"
    files = meta.get("files")
    if not isinstance(files, dict):
        return f"field 'files' must be an object of file name -> {{sha256, bytes}}, got {files!r:.60}"
    for name, info in files.items():
        if not _is_plain_name(name) or name == META:
            return f"lists {name!r}, which is not a plain file name of the checkpoint folder"
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str)
                and isinstance(info.get("bytes"), int) and not isinstance(info.get("bytes"), bool)):
            return f"entry for {name} must be {{\"sha256\": hex, \"bytes\": int}}, got {info!r:.60}"
    return None


def run_folder_of(path) -> Path | None:
    """The run folder of a ``RUN/checkpoints/step-N`` folder, or None for a checkpoint folder elsewhere."""
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else None


def _model_section(doc) -> dict | None:
    """A config document's model settings, the keys added since it was written at their defaults."""
    from ..config import with_defaults
    return with_defaults(doc)["model"] if isinstance(doc, dict) and isinstance(doc.get("model"), dict) else None


def check_identity(path, meta: dict) -> None:
    """A checkpoint belongs where it lies: a ``step-N`` folder holds step N, and a checkpoint in
    ``RUN/checkpoints/`` has the model of ``RUN/config.json`` (runtime keys aside)."""
    path = Path(path)
    m = _NAME.match(path.name)
    if m and int(m.group(1)) != meta["step"]:
        raise CheckpointError(f"checkpoint {path}: the folder is named for step {m.group(1)} but its {META} says "
                              f"step {meta['step']} (copied or renamed from elsewhere?); move it out of the way")
    run = run_folder_of(path)
    if run is None or CONFIG not in meta["files"] or not (run / CONFIG).exists():
        return
    run_cfg = run / CONFIG
    try:
        theirs = _model_section(read_json(run_cfg))
    except (OSError, ValueError):
        theirs = None
    if theirs is None:
        raise CheckpointError(f"checkpoint {path}: cannot check it against the run's config: {run_cfg} is not a "
                              f"readable fibattn config (no 'model' section)")
    try:
        mine = _model_section(read_json(path / CONFIG))
    except (OSError, ValueError):
        mine = None
    if mine is None:
        raise CheckpointError(f"checkpoint {path}: file {CONFIG} is not a fibattn config (no 'model' section)")
    for k in sorted((set(mine) | set(theirs)) - set(RUNTIME_MODEL_KEYS)):
        if mine.get(k) != theirs.get(k):
            raise CheckpointError(f"checkpoint {path} does not belong to run {run}: its model.{k} is "
                                  f"{mine.get(k)!r} but {run_cfg} has {theirs.get(k)!r} (copied from another run?)")


def verify(path) -> dict:
    """Check a checkpoint folder; returns its meta, or raises :class:`CheckpointError`.

    Checks the shape of ``meta.json``, every listed file's size and sha256, and the
    checkpoint's identity (:func:`check_identity`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a folder")
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {META} is missing")
    try:
        meta = read_json(meta_path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {META} is unreadable ({exc})") from None
    problem = _meta_problem(meta)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {META} {problem}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r} is not supported (want {FORMAT})")
    for name, info in sorted(meta["files"].items()):
        problem = listed_file_problem(path / name, info)
        if problem:
            raise CheckpointError(f"checkpoint {path}: file {name} {problem}")
    check_identity(path, meta)
    return meta


def latest_valid(root, *, pinned: bool = False) -> Path | None:
    """The newest checkpoint that verifies; bad ones are skipped with a warning naming the file.
    ``pinned`` (readers): the one returned is pinned (:func:`pin`) first, and one pruned meanwhile is
    passed over for the next complete one."""
    for _, path in reversed(list_checkpoints(root)):
        if pinned and not pin(path) and not path.is_dir():
            continue                                # pruned meanwhile; an incomplete one is named below
        try:
            verify(path)
            return path
        except CheckpointError as exc:
            if pinned:
                unpin(path)
            log.warning("fibattn: skipping checkpoint: %s", exc)
    return None


def none_verifies(root) -> str:
    """Why no checkpoint of ``root`` verifies: how many there are and what is wrong with the newest."""
    existing = list_checkpoints(root)
    if not existing:
        return f"{root} holds no checkpoint"
    newest = existing[-1][1]
    try:
        verify(newest)
        why = ""
    except CheckpointError as exc:
        why = f" ({exc})"
    return f"{root} holds {len(existing)} checkpoint(s) but none verifies (newest {newest.name}{why})"


@dataclass
class Checkpoint:
    """A verified checkpoint folder; read parts with :meth:`tensors` and :meth:`state`."""

    path: Path
    meta: dict

    @classmethod
    def open(cls, path) -> "Checkpoint":
        return cls(Path(path), verify(path))

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def has(self, name: str) -> bool:
        files = self.meta["files"]
        return f"{name}.json" in files or f"{name}.safetensors" in files

    def _read(self, filename: str) -> bytes:
        if filename not in self.meta["files"]:
            raise CheckpointError(f"checkpoint {self.path} has no {filename}")
        return (self.path / filename).read_bytes()

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return st_load(self._read(f"{name}.safetensors"))
        except CheckpointError:
            raise
        except Exception as exc:              # safetensors refuses anything that is not safetensors
            raise CheckpointError(f"checkpoint {self.path}: file {name}.safetensors is not a valid safetensors "
                                  f"file ({exc})") from None

    def state(self, name: str) -> Any:
        st = f"{name}.safetensors"
        js, tensors = self._read(f"{name}.json"), self._read(st) if st in self.meta["files"] else None
        try:
            return decode_state(js, tensors)
        except Exception as exc:              # JSON + safetensors only: anything else is refused
            raise CheckpointError(f"checkpoint {self.path}: state {name} ({name}.json / {st}) is not valid "
                                  f"JSON + safetensors ({type(exc).__name__}: {exc})") from None
