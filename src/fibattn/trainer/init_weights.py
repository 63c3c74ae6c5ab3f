"""The weights a run starts from (``train.init_from``): opened and checked before anything is
written, or — when the run resumes — only checked to be the source the run started from.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..config import RunConfig
from ..config_files import load as load_config
from ..model.lm import FibLM
from ..storage import checkpoint as ck
from ..storage.init_source import check_resumable, open_source, plan


def resumed_init(cfg: RunConfig, resume: str) -> dict | None:
    """When a run with ``train.init_from`` will resume: the ``init_source`` its config recorded (None when it
    starts fresh). Resuming keeps the checkpoint's weights, so only the fine-tune of that same source may
    continue (:func:`~fibattn.storage.init_source.check_resumable` refuses anything else)."""
    out = Path(cfg.train.out_dir)
    if str(resume) in ("auto", "never") and not (str(resume) == "auto" and ck.list_checkpoints(ck.ckpt_root(out))):
        return None
    saved = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        saved = load_config(out / "config.json").train
    check_resumable(cfg.train.init_from, str(resume), out, None if saved is None else saved.init_from)
    return saved.init_source


def open_init(cfg: RunConfig, resume: str = "never"):
    """``train.init_from``'s weights, checked against the model ``cfg`` describes (shapes on the meta
    device, nothing allocated); records their provenance in ``train.init_source``. None without a
    source, and when the run will resume (the source is not needed then, and may be gone)."""
    if not cfg.train.init_from:
        cfg.train.init_source = {}
        return None
    saved = resumed_init(cfg, resume)
    if saved is not None:
        cfg.train.init_source = saved
        return None
    source = open_source(cfg.train.init_from)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in FibLM(cfg.model).state_dict().items()}
    plan(source, shapes)
    cfg.train.init_source = source.record()
    return source
