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

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..storage import checkpoint as ck
from ..storage.shapes import check_shapes, load_checked
from ..config import RunConfig, save as save_config, with_defaults
from ..effective import recorded, unread
from ..files import atomic_write_bytes, read_json
from .distributed import DistInfo, broadcast_int, together

log = logging.getLogger("fibattn")

RUNTIME_MODEL_KEYS = ck.RUNTIME_MODEL_KEYS   # may change on resume: the weights do not depend on them


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
    tmp = root / f"step-{step}.tmp"
    with together(dist, f"starting checkpoint {tmp}"):       # a rank that fails: every rank says which, and why
        if dist.is_main:
            ck.begin(root, step)
    with together(dist, f"writing checkpoint {tmp}"):
        try:
            ck.write_state(tmp, f"rng-rank{dist.rank}", rng_state(dist.device))
            ck.write_state(tmp, f"loader-rank{dist.rank}", loader.state_dict())
            if dist.is_main:
                ck.write_tensors(tmp, "model", model.state_dict())
                ck.write_state(tmp, "optimizer", {"param_names": names, "state": optimizer.state_dict()})
                ck.write_state(tmp, "trainer", {**trainer, "step": step, "world_size": dist.world_size})
                save_config(cfg, tmp / "config.json")            # only the settings that act
                if tokenizer_file is not None:             # synced like every file of the folder (not copyfile)
                    atomic_write_bytes(tmp / "tokenizer.json", Path(tokenizer_file).read_bytes())
        except OSError as exc:               # disk full, permissions: one line naming the folder and the setting
            shutil.rmtree(tmp, ignore_errors=True)
            newest = ck.latest_valid(root)
            raise OSError(exc.errno, f"cannot write checkpoint {tmp} (train.out_dir): {exc.strerror or exc}; "
                                     f"newest complete checkpoint: {newest or 'none'} (continue with --resume "
                                     f"auto)") from None
    final = ck.step_dir(root, step)
    with together(dist, f"finishing checkpoint {final}"):
        if dist.is_main:
            final = ck.finish(root, step)
            ck.prune(root, keep, upto=step)
    return final


def find_resume(out_dir, resume: str, dist: DistInfo) -> Path | None:
    """The checkpoint to resume from: ``never`` | ``auto`` | a checkpoint folder path.

    Rank 0 decides (verifying hashes and identity) and broadcasts the step, so every rank agrees.

    - ``auto``: the newest checkpoint that verifies; newer ones that fail are skipped with a warning
      (and set aside, never deleted, if training reaches their step). When checkpoints exist but
      none verifies, this is an error rather than a silent start from step 0.
    - a path: refused when ``OUT/checkpoints`` holds a checkpoint newer than it (training would
      overwrite or be overtaken by it), or holds checkpoints of its own while the path lies
      elsewhere (two runs would mix); branch into a new ``--out`` instead.
    """
    root = ck.ckpt_root(out_dir)
    if resume not in ("auto", "never"):
        path = Path(resume)
        ck.pin(path)                 # another live run's checkpoint is not pruned while it is read
        with together(dist, "checking --resume"):
            if dist.is_main:
                meta = ck.verify(path)
                check_no_newer(root, path, int(meta["step"]))
                ck.clean_tmp(root)
        return path
    step = -1
    with together(dist, "choosing the checkpoint to resume from"):
        if dist.is_main:
            step = _auto_step(root, resume)
    step = broadcast_int(dist, step)
    return None if step < 0 else ck.step_dir(root, step)


def _auto_step(root: Path, resume: str) -> int:
    """Rank 0's choice for ``auto`` / ``never``: the step to resume from, or -1 for a fresh start."""
    step = -1
    existing = ck.list_checkpoints(root)
    if resume == "never" and existing:
        raise ck.CheckpointError(
            f"{root} already holds checkpoints (newest step-{existing[-1][0]}); pass --resume auto to "
            f"continue that run, or choose a fresh train.out_dir / --out")
    if resume == "auto":
        ck.clean_tmp(root)                   # half-written step-N.tmp folders of an interrupted save
        existing = ck.list_checkpoints(root)
        found = ck.latest_valid(root)
        if found is None and existing:
            raise ck.CheckpointError(
                f"{ck.none_verifies(root)}; "
                f"starting over would abandon them: repair or move them away, or train into a new --out")
        step = -1 if found is None else ck.Checkpoint.open(found).step
    return step


def check_no_newer(root: Path, path: Path, step: int) -> None:
    """Refuse to resume ``path`` (step ``step``) into the run whose checkpoints are in ``root`` when that
    would overwrite, prune or be overtaken by checkpoints already there."""
    existing = ck.list_checkpoints(root)
    newer = [p.name for s, p in existing if s > step]
    out = root.parent
    branch = f"{out.name}-from-{step}"
    if newer:
        shown = ", ".join(newer[:6]) + (f", ... ({len(newer)} in all)" if len(newer) > 6 else "")
        raise ck.CheckpointError(
            f"cannot resume from {path} (step {step}) into {out}: {root} holds newer checkpoints ({shown}) that this "
            f"run would overwrite and that --resume auto would later pick instead; to branch from step {step}, "
            f"train into a new folder (--out {out.parent / branch} --resume {path}); to continue the newest, use "
            f"--resume auto")
    inside = path.resolve().parent == root.resolve() if root.is_dir() else False
    if existing and not inside:
        raise ck.CheckpointError(
            f"cannot resume from {path} into {out}: {root} already holds checkpoints of another run (newest "
            f"{existing[-1][1].name}); train the branch into a new folder (--out {out.parent / branch})")


def saved_config(path: Path) -> dict:
    """The run config in checkpoint ``path`` as a dict (a CheckpointError naming the file if it is not one)."""
    f = Path(path) / ck.CONFIG
    try:
        saved = read_json(f)
    except (OSError, ValueError) as exc:
        raise ck.CheckpointError(f"checkpoint {path}: file {ck.CONFIG} is unreadable ({exc})") from None
    if not (isinstance(saved, dict) and all(isinstance(saved.get(k), dict) for k in ("model", "data", "train"))):
        raise ck.CheckpointError(f"checkpoint {path}: file {ck.CONFIG} is not a fibattn run config")
    return saved


def new_window() -> dict:
    """The trainer's loss/time window since the last progress line (saved in every checkpoint)."""
    return {"loss": 0.0, "n": 0, "time": 0.0, "steps": 0}


def saved_window(w) -> dict | None:
    """A loss window read from a checkpoint's trainer state, or None (older checkpoints have none)."""
    if not isinstance(w, dict) or set(w) != set(new_window()):
        return None
    if not all(isinstance(w[k], (int, float)) and not isinstance(w[k], bool) for k in w):
        return None
    return {"loss": float(w["loss"]), "n": int(w["n"]), "time": float(w["time"]), "steps": int(w["steps"])}


def check_compatible(saved: dict, cfg: RunConfig, path: Path) -> list[str]:
    """Raise if the model differs from the checkpoint's; return other changed keys. Settings ``cfg`` does not
    read are not compared (a run records only what acts; an older one recorded every key)."""
    now, saved, off = with_defaults(recorded(cfg)), with_defaults(saved), unread(cfg)
    keys = {k for k in set(saved["model"]) | set(now["model"]) if f"model.{k}" not in off}
    diff_model = sorted(k for k in keys - set(RUNTIME_MODEL_KEYS) if saved["model"].get(k) != now["model"].get(k))
    if diff_model:
        k = diff_model[0]
        raise ck.CheckpointError(f"cannot resume from {path}: model.{k} is {now['model'].get(k)!r} but the "
                                 f"checkpoint has {saved['model'].get(k)!r}")
    changed = [f"model.{k}" for k in RUNTIME_MODEL_KEYS if saved["model"].get(k) != now["model"].get(k)
               and f"model.{k}" not in off]
    for section in ("data", "train"):
        for k in sorted(set(saved[section]) | set(now[section])):
            if saved[section].get(k) != now[section].get(k) and k != "out_dir" and f"{section}.{k}" not in off:
                changed.append(f"{section}.{k}")
    return changed


def check_moments(optimizer, names: list[str], where: str) -> None:
    """Every loaded optimizer moment has its parameter's shape: torch does not check (AdamW would broadcast a
    wrong one silently)."""
    params = [q for group in optimizer.param_groups for q in group["params"]]
    for name, param in zip(names, params):
        moments = {k: v for k, v in optimizer.state.get(param, {}).items() if torch.is_tensor(v) and v.dim()}
        check_shapes(moments, dict.fromkeys(moments, tuple(param.shape)), described=f"parameter {name}",
                     where=f"{where}: optimizer state of {name}", error=ck.CheckpointError)


def restore(path: Path, *, model, optimizer, names: list[str], loader, dist: DistInfo) -> dict:
    """Load every part of a verified checkpoint; returns the trainer state dict."""
    c = ck.Checkpoint.open(path)
    trainer = c.state("trainer")
    saved_step = trainer.get("step") if isinstance(trainer, dict) else None
    if saved_step != c.step:
        raise ck.CheckpointError(f"checkpoint {path}: trainer.json's step {saved_step!r} does not match "
                                 f"{ck.META}'s step {c.step}")
    for key in ("tokens", "skipped", "bad", "elapsed", "world_size"):
        value = trainer.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ck.CheckpointError(f"checkpoint {path}: trainer.json field {key!r} must be a number, got {value!r}")
    same = trainer["world_size"] == dist.world_size
    if not same and dist.is_main:
        log.warning("fibattn: checkpoint %s was written by %d processes, resuming with %d: the data position "
                    "carries over, bit-exact continuation does not", path, trainer["world_size"], dist.world_size)
    mine = dist.rank if same else 0
    load_checked(model, c.tensors("model"), file=f"checkpoint {path}: file {ck.MODEL}", described="the run's config",
                 error=ck.CheckpointError)
    opt = c.state("optimizer")
    if opt["param_names"] != names:
        raise ck.CheckpointError(f"checkpoint {path}: optimizer parameters do not match the model's")
    optimizer.load_state_dict(opt["state"])
    check_moments(optimizer, names, f"checkpoint {path}")
    loader.load_state_dict(c.state(f"loader-rank{mine}"))
    set_rng_state(c.state(f"rng-rank{mine}"), dist.device)
    return trainer
