"""Saving and restoring the full training state through :mod:`fibattn.storage.checkpoint`.

A training checkpoint holds ``model.safetensors``, ``optimizer`` (state keyed by
parameter name order), ``trainer`` (step, tokens, counters, world size), ``config.json``,
the data's ``tokenizer.json`` (when it has one) and, per rank ``r``, ``rng-rank{r}`` (torch CPU/CUDA, numpy, python) and
``loader-rank{r}`` (the data loader's position). Every rank writes its own files into
the ``.tmp`` folder; rank 0 writes the rest, then ``meta.json`` and renames. Resuming with
another number of processes is allowed (the loader continues from the global position in
rank 0's state) but is not bit-exact.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..storage import checkpoint as ck
from ..config import RunConfig, to_dict
from ..files import atomic_write_text
from .distributed import DistInfo, barrier, broadcast_int

log = logging.getLogger("fibattn")

RUNTIME_MODEL_KEYS = ("backend", "reach", "max_seq_len")   # may change on resume: the weights do not depend on them


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(out_dir, step: int, *, model, optimizer, names: list[str], loader, trainer: dict, cfg: RunConfig,
         dist: DistInfo, keep: int, tokenizer_file: Path | None = None) -> Path:
    root = ck.ckpt_root(out_dir)
    if dist.is_main:
        ck.begin(root, step)
    barrier(dist)
    tmp = root / f"step-{step}.tmp"
    ck.write_state(tmp, f"rng-rank{dist.rank}", rng_state(dist.device))
    ck.write_state(tmp, f"loader-rank{dist.rank}", loader.state_dict())
    if dist.is_main:
        ck.write_tensors(tmp, "model", model.state_dict())
        ck.write_state(tmp, "optimizer", {"param_names": names, "state": optimizer.state_dict()})
        ck.write_state(tmp, "trainer", {**trainer, "step": step, "world_size": dist.world_size})
        atomic_write_text(tmp / "config.json", json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    barrier(dist)
    final = ck.step_dir(root, step)
    if dist.is_main:
        final = ck.finish(root, step)
        ck.prune(root, keep)
    barrier(dist)
    return final


def find_resume(out_dir, resume: str, dist: DistInfo) -> Path | None:
    """The checkpoint to resume from: ``never`` | ``auto`` | a checkpoint folder path.

    Rank 0 decides (verifying hashes) and broadcasts the step, so every rank agrees.
    """
    root = ck.ckpt_root(out_dir)
    if resume not in ("auto", "never"):
        path = Path(resume)
        if dist.is_main:
            ck.verify(path)
        barrier(dist)
        return path
    step = -1
    if dist.is_main:
        existing = ck.list_checkpoints(root)
        if resume == "never" and existing:
            raise ck.CheckpointError(
                f"{root} already holds checkpoints (newest step-{existing[-1][0]}); pass --resume auto to "
                f"continue that run, or choose a fresh train.out_dir / --out")
        if resume == "auto":
            ck.clean_tmp(root)                   # half-written step-N.tmp folders of an interrupted save
            found = ck.latest_valid(root)
            step = -1 if found is None else ck.Checkpoint.open(found).step
    step = broadcast_int(dist, step)
    return None if step < 0 else ck.step_dir(root, step)


def check_compatible(saved: dict, cfg: RunConfig, path: Path) -> list[str]:
    """Raise if the model differs from the checkpoint's; return other changed keys."""
    now = to_dict(cfg)
    keys = set(saved["model"]) | set(now["model"])
    diff_model = sorted(k for k in keys - set(RUNTIME_MODEL_KEYS) if saved["model"].get(k) != now["model"].get(k))
    if diff_model:
        k = diff_model[0]
        raise ck.CheckpointError(f"cannot resume from {path}: model.{k} is {now['model'].get(k)!r} but the "
                                 f"checkpoint has {saved['model'].get(k)!r}")
    changed = [f"model.{k}" for k in RUNTIME_MODEL_KEYS if saved["model"].get(k) != now["model"].get(k)]
    for section in ("data", "train"):
        for k in sorted(set(saved[section]) | set(now[section])):
            if saved[section].get(k) != now[section].get(k) and k != "out_dir":
                changed.append(f"{section}.{k}")
    return changed


def restore(path: Path, *, model, optimizer, names: list[str], loader, dist: DistInfo) -> dict:
    """Load every part of a verified checkpoint; returns the trainer state dict."""
    c = ck.Checkpoint.open(path)
    trainer = c.state("trainer")
    same = trainer["world_size"] == dist.world_size
    if not same and dist.is_main:
        log.warning("fibattn: checkpoint %s was written by %d processes, resuming with %d: the data position "
                    "carries over, bit-exact continuation does not", path, trainer["world_size"], dist.world_size)
    mine = dist.rank if same else 0
    model.load_state_dict(c.tensors("model"), strict=True)
    opt = c.state("optimizer")
    if opt["param_names"] != names:
        raise ck.CheckpointError(f"checkpoint {path}: optimizer parameters do not match the model's")
    optimizer.load_state_dict(opt["state"])
    loader.load_state_dict(c.state(f"loader-rank{mine}"))
    set_rng_state(c.state(f"rng-rank{mine}"), dist.device)
    return trainer
