"""Load a trained model from a run folder (or one checkpoint folder), safely.

    model, cfg, tokenizer = load_run("runs/tiny")                 # newest complete, verified checkpoint
    model, cfg, tokenizer = load_run("runs/tiny", step=400, model_overrides=["model.reach=train"])

Only safetensors and JSON are read (no pickle); every file's sha256 is checked first.
``model_overrides`` may change settings that do not alter the weights: ``model.reach``,
``model.backend`` and ``model.max_seq_len``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from . import checkpoint as ck
from .. import config as C
from ..model.lm import FibLM

log = logging.getLogger("fibattn")

RUNTIME_KEYS = ("model.reach", "model.backend", "model.max_seq_len")
EVAL_JSON = "eval.json"         # what ``fibattn eval`` writes into a run folder


def read_eval_doc(path) -> dict | None:
    """The evaluation document ``fibattn eval`` writes (``RUN/eval.json``): None when the file
    is absent, a ValueError naming it when it is not such a document."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = None
    if not (isinstance(doc, dict) and isinstance(doc.get("results"), list)):
        raise ValueError(f"{path} exists but is not an eval JSON file")
    return doc


def parse_step(text, flag: str = "--step"):
    """A checkpoint step as users write it: ``"latest"`` or an integer >= 0 (the one parser)."""
    if text == "latest" or (isinstance(text, int) and not isinstance(text, bool) and text >= 0):
        return text
    try:
        value = int(str(text).strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{flag} must be 'latest' or an integer >= 0, got {text!r}")
    return value


def find_checkpoint(run_dir, step="latest") -> Path:
    """The checkpoint folder of ``run_dir`` for ``step`` (``"latest"`` or an int), verified."""
    path = Path(run_dir)
    if (path / ck.META).is_file() or ck._NAME.match(path.name):
        if step != "latest":
            raise ValueError(f"{path} is a checkpoint folder; step must be 'latest' there, got {step!r}")
        ck.verify(path)
        return path
    root = ck.ckpt_root(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{path} is not a run folder (no checkpoints/ inside) nor a checkpoint folder")
    if step == "latest":
        found = ck.latest_valid(root)
        if found is None:
            raise ck.CheckpointError(f"no complete, verified checkpoint in {root}")
        return found
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be 'latest' or an integer >= 0, got {step!r}")
    target = ck.step_dir(root, step)
    if not target.is_dir():
        have = ", ".join(str(s) for s, _ in ck.list_checkpoints(root)) or "none"
        raise FileNotFoundError(f"no checkpoint step-{step} in {root} (have: {have})")
    ck.verify(target)
    return target


def _tokenizer(path: Path, cfg: C.RunConfig):
    from ..data import load_tokenizer
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(path / "tokenizer.json")
    data_dir = Path(cfg.data.out_dir)
    if data_dir.is_dir():
        return load_tokenizer(data_dir)
    log.warning("fibattn: no tokenizer in %s and data folder %s is missing; tokenizer is None", path, data_dir)
    return None


def load_run(run_dir, step="latest", *, device="cpu", model_overrides: list[str] | None = None):
    """``(model, cfg, tokenizer)`` from the checkpoint; the model is in eval mode on ``device``."""
    path = find_checkpoint(run_dir, step)
    c = ck.Checkpoint.open(path)
    cfg = C.from_dict(json.loads(c._read("config.json")))
    for item in model_overrides or []:
        key = item.split("=", 1)[0].strip()
        if key not in RUNTIME_KEYS:
            raise ValueError(f"model_overrides may only set {', '.join(RUNTIME_KEYS)}, got {key!r}")
    C.apply_overrides(cfg, list(model_overrides or []))
    C.validate_model(cfg.model)
    model = FibLM(cfg.model)
    model.load_state_dict(c.tensors("model"), strict=True)
    model.to(torch.device(device)).eval()
    return model, cfg, _tokenizer(path, cfg)
