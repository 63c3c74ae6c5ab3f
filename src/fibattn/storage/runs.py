"""Load a trained model from a run folder (or one checkpoint folder), safely.

    model, cfg, tokenizer = load_run("runs/tiny")                 # newest complete, verified checkpoint
    model, cfg, tokenizer = load_run("runs/tiny", step=400, model_overrides=["model.reach=train"])

Only safetensors and JSON are read (no pickle); every file's sha256 is checked first.
``model_overrides`` may change settings that do not alter the weights: ``model.reach``,
``model.backend`` and ``model.max_seq_len``.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..files import parse_json, read_json
from ..checks import UsageError
from . import checkpoint as ck
from .foreign import foreign_hint
from .shapes import load_checked
from .. import config as C
from ..model.lm import FibLM
from ..model.rope import SCALING_KINDS
from ..effective import check_honoured, given_by_set
from ..validation import validate_model

log = logging.getLogger("fibattn")

RUNTIME_KEYS = ("model.reach", "model.backend", "model.max_seq_len")
EVAL_JSON = "eval.json"         # what ``fibattn eval`` writes into a run folder


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _entry_problem(r) -> str | None:
    """What is wrong with one ``results`` entry of an eval document (None when it is usable)."""
    if not isinstance(r, dict):
        return f"is not an object (got {type(r).__name__})"
    for key, ok, want in (("dataset", isinstance(r.get("dataset"), str), "a string"),
                          ("length", _is_int(r.get("length")) and r.get("length", 0) >= 1, "an integer >= 1"),
                          ("mode", isinstance(r.get("mode"), str), "a string")):
        if not ok:
            return f"field {key!r} must be {want}, got {r.get(key)!r:.40}" if key in r else f"has no {key!r}"
    for key, ok, want in (("ppl", lambda v: _is_num(v), "a number"),
                          ("bpb", lambda v: v is None or _is_num(v), "a number or null"),
                          ("nll", lambda v: _is_num(v), "a number"),
                          ("tokens", lambda v: _is_int(v), "an integer"),
                          ("step", lambda v: _is_int(v), "an integer"),
                          ("rope_scaling", lambda v: v is None or v in SCALING_KINDS, "one of "
                           f"{', '.join(SCALING_KINDS)} or null"),
                          ("rope_factor", lambda v: v is None or (_is_num(v) and v >= 1), "a number >= 1 or null")):
        if key in r and not ok(r[key]):
            return f"field {key!r} must be {want}, got {r[key]!r:.40}"
    buckets = r.get("buckets", [])
    if not isinstance(buckets, list) or not all(
            isinstance(b, dict) and all(_is_num(b.get(k)) for k in ("start", "end", "loss")) for b in buckets):
        return "field 'buckets' must be a list of {start, end, loss} numbers"
    return None


def eval_doc_problem(doc) -> str | None:
    """What is wrong with a parsed eval document (None when every part a reader uses is well formed)."""
    if not (isinstance(doc, dict) and isinstance(doc.get("results"), list)):
        return "is not an eval JSON file (want an object with a 'results' list)"
    for i, r in enumerate(doc["results"]):
        problem = _entry_problem(r)
        if problem:
            where = f"results[{i}]" + (f" ({r.get('dataset')}, {r.get('length')}, {r.get('mode')})"
                                       if isinstance(r, dict) else "")
            return f"entry {where} {problem}"
    for key in ("datasets", "last_settings", "alphas"):
        if key in doc and not isinstance(doc[key], dict):
            return f"field {key!r} must be an object, got {type(doc[key]).__name__}"
    alphas = doc.get("alphas", {})
    if "end" in alphas and not (isinstance(alphas["end"], list) and all(_is_num(a) for a in alphas["end"])):
        return "field 'alphas.end' must be a list of numbers"
    if "largest_move_line" in alphas and not isinstance(alphas["largest_move_line"], str):
        return "field 'alphas.largest_move_line' must be a string"
    return None


def read_eval_doc(path) -> dict | None:
    """The evaluation document ``fibattn eval`` writes (``RUN/eval.json``): None when the file
    is absent, a ValueError naming it when it is not such a document or an entry is malformed
    (every ``results`` entry is an object with ``dataset``, ``length`` and ``mode``, and the
    numbers readers use are numbers)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} exists but is not an eval JSON file (not valid JSON: {exc})") from None
    problem = eval_doc_problem(doc)
    if problem:
        raise UsageError(f"{path} exists but {problem}" if problem.startswith("is ") else f"{path}: {problem}")
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
        raise UsageError(f"{flag} must be 'latest' or an integer >= 0, got {text!r}")
    return value


def find_checkpoint(run_dir, step="latest") -> Path:
    """The checkpoint folder of ``run_dir`` for ``step`` (``"latest"`` or an int), verified and pinned
    (:func:`fibattn.storage.checkpoint.pin`: a run that is training does not prune it while this process reads it)."""
    path = Path(run_dir)
    if (path / ck.META).is_file() or ck._NAME.match(path.name):
        if step != "latest":
            raise UsageError(f"{path} is a checkpoint folder; step must be 'latest' there, got {step!r}")
        ck.pin(path)              # kept from pruning while read; verify names what is wrong when it is not there
        ck.verify(path)
        return path
    root = ck.ckpt_root(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{path} is not a run folder (no checkpoints/ inside) nor a checkpoint folder"
                                f"{foreign_hint(path)}")
    if step == "latest":
        found = ck.latest_valid(root, pinned=True)       # pinned: a live run does not prune it while it is read
        if found is None:
            raise ck.CheckpointError(f"no complete, verified checkpoint: {ck.none_verifies(root)}")
        return found
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"step must be 'latest' or an integer >= 0, got {step!r}")
    target = ck.step_dir(root, step)
    if not target.is_dir():
        have = ", ".join(str(s) for s, _ in ck.list_checkpoints(root)) or "none"
        raise FileNotFoundError(f"no checkpoint step-{step} in {root} (have: {have})")
    ck.pin(target)
    ck.verify(target)
    return target


def checkpoint_config(c: ck.Checkpoint) -> C.RunConfig:
    """The run config stored in a verified checkpoint (a CheckpointError naming the file if it is not one)."""
    try:
        return C.from_dict(parse_json(c._read(ck.CONFIG)))
    except ck.CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ck.CheckpointError(f"checkpoint {c.path}: file {ck.CONFIG} is not a valid fibattn run config "
                                 f"({exc})") from None


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
    cfg = checkpoint_config(c)
    for item in model_overrides or []:
        key = item.split("=", 1)[0].strip()
        if key not in RUNTIME_KEYS:
            raise UsageError(f"model_overrides (generate --set) may only set {', '.join(RUNTIME_KEYS)}, got {key!r}")
    C.apply_overrides(cfg, list(model_overrides or []))
    check_honoured(cfg, {k: f"model_overrides (generate --set) {k}" for k in given_by_set(model_overrides)})
    try:
        validate_model(cfg.model)
    except C.ConfigError as exc:        # an override that does not fit the run's other settings: name it
        given = ", ".join(map(str, model_overrides or [])) or "none"
        raise C.ConfigError(f"model_overrides (generate --set) {given} do not fit the checkpoint {path}: {exc}") \
            from None
    model = FibLM(cfg.model)
    load_checked(model, c.tensors("model"), file=f"checkpoint {path}: file {ck.MODEL}", described=f"its {ck.CONFIG}",
                 error=ck.CheckpointError)
    model.to(torch.device(device)).eval()
    return model, cfg, _tokenizer(path, cfg)
