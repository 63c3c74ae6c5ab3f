"""Load a portable fibattn model folder (written by ``fibattn export``), safely.

    model = fibattn.from_pretrained("exports/tiny")            # a FibLM in eval mode
    bundle = load_pretrained("exports/tiny")                   # .model .model_config .tokenizer .meta
    model, tokenizer = load_model("runs/tiny_or_export")       # either kind of folder

Folder layout (``FORMAT`` 1)::

    config.json          {"fibattn_format": 1, "fibattn_version", "model_type": "fibattn",
                          "model": <ModelConfig fields>, "files": {name: {"sha256", "bytes"}},
                          "tokenizer": "fibattn_tokenizer.json" | null, "source": {...}}
    model.safetensors    the FibLM state_dict (plain keys, metadata {"format": "pt"})
    fibattn_tokenizer.json  the run's tokenizer file, byte for byte (read by fibattn; exports before it named
                         their copy tokenizer.json, which "tokenizer" still names and fibattn still reads)
    tokenizer.json, tokenizer_config.json   the same tokenizer for transformers' AutoTokenizer
    README.md            a model card (not read back)

Only JSON and safetensors are read (no pickle anywhere); every file listed in
``config.json`` is checked for presence, size and sha256 before anything is loaded, and a
problem raises :class:`ExportError` naming the file.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load

try:
    from safetensors import SafetensorError
except ImportError:                       # older safetensors
    from safetensors._safetensors_rust import SafetensorError

from ..checks import UsageError, check_keys
from ..data.tokenizers import EXPORTED_TOKENIZER_FILE
from ..config import RunConfig
from ..effective import check_honoured
from ..files import listed_file_problem, parse_json, read_json
from .foreign import foreign_hint
from .shapes import load_checked

FORMAT = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
FIBATTN_TOKENIZER = EXPORTED_TOKENIZER_FILE
CARD = "README.md"


class ExportError(UsageError):
    """A portable model folder is missing a file, has a corrupted one, or is not an export."""


@dataclass
class Pretrained:
    """What :func:`load_pretrained` returns."""

    model: torch.nn.Module
    model_config: object          # fibattn.config.ModelConfig
    tokenizer: object | None      # ByteTokenizer | BPETokenizer | None
    meta: dict                    # the parsed config.json


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_export(path) -> bool:
    """True when ``path`` is a folder holding a fibattn ``config.json`` (format marker present)."""
    cfg = Path(path) / CONFIG
    if not cfg.is_file():
        return False
    try:
        doc = read_json(cfg)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "fibattn_format" in doc


def read_meta(path) -> dict:
    """The parsed, checked ``config.json`` of an export folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ExportError(f"{folder} does not exist or is not a folder (expected a fibattn export)")
    cfg = folder / CONFIG
    if not cfg.is_file():
        raise ExportError(f"{folder}: {CONFIG} is missing (not a fibattn export folder; write one with "
                          f"`fibattn export RUN OUT`)")
    try:
        doc = read_json(cfg)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{folder}: {CONFIG} is corrupted (not valid JSON: {exc})") from None
    if not isinstance(doc, dict) or "fibattn_format" not in doc:
        hint = (" — it is a training run's config: load the run with fibattn.from_pretrained / load_model, or write "
                f"an export with `fibattn export {folder} OUT`" if isinstance(doc, dict) and "train" in doc
                else foreign_hint(folder))
        raise ExportError(f"{folder}: {CONFIG} is not a fibattn export config (no fibattn_format key){hint}")
    if doc["fibattn_format"] != FORMAT:
        raise ExportError(f"{folder}: {CONFIG} has fibattn_format {doc['fibattn_format']!r}; this fibattn "
                          f"reads format {FORMAT}")
    for key in ("model", "files"):
        if not isinstance(doc.get(key), dict):
            raise ExportError(f"{folder}: {CONFIG} is corrupted (field {key!r} missing or not an object)")
    for name in doc["files"]:
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ExportError(f"{folder}: {CONFIG} is corrupted (lists {name!r}, which is not a plain file name of "
                              f"the folder)")
    if WEIGHTS not in doc["files"]:
        raise ExportError(f"{folder}: {CONFIG} lists no {WEIGHTS}")
    if doc.get("tokenizer") is not None and not isinstance(doc["tokenizer"], str):
        raise ExportError(f"{folder}: {CONFIG} is corrupted (field 'tokenizer' must be a file name or null, got "
                          f"{doc['tokenizer']!r:.40})")
    return doc


def read_verified(folder: Path, name: str, meta: dict) -> bytes:
    """The bytes of a listed file after checking its size and sha256."""
    info = meta["files"].get(name)
    if not isinstance(info, dict) or "sha256" not in info or "bytes" not in info:
        raise ExportError(f"{folder}: {CONFIG} has no size/sha256 entry for {name}")
    path = folder / name
    if not path.is_file():
        raise ExportError(f"{folder}: file {name} is missing")
    data = path.read_bytes()
    problem = listed_file_problem(path, info, data)
    if problem:
        raise ExportError(f"{folder}: file {name} {problem}")
    return data


def verify_export(path) -> dict:
    """Check every listed file of an export folder; returns the parsed ``config.json``."""
    folder = Path(path)
    meta = read_meta(folder)
    for name in sorted(meta["files"]):
        read_verified(folder, name, meta)
    return meta


def _model_config(meta: dict, folder: Path):
    from ..config import ConfigError, from_dict
    try:
        return from_dict({"model": dict(meta["model"])}).model
    except (ConfigError, TypeError) as exc:
        raise ExportError(f"{folder}: {CONFIG} field 'model' is not a valid fibattn model config ({exc})") from None


def _tokenizer(folder: Path, meta: dict):
    name = meta.get("tokenizer")
    if name is None:
        return None
    data = read_verified(folder, name, meta)
    from ..data.tokenizers import load_tokenizer
    try:
        parse_json(data)
    except ValueError as exc:
        raise ExportError(f"{folder}: file {name} is corrupted (not valid JSON: {exc})") from None
    return load_tokenizer(folder / name)


def load_pretrained(path, *, device="cpu", model_overrides: dict | None = None) -> Pretrained:
    """Model (eval mode, on ``device``), its ModelConfig, tokenizer and meta from an export folder.

    ``model_overrides`` may set runtime fields that do not change the weights:
    ``reach``, ``backend``, ``max_seq_len``.
    """
    from ..validation import validate_model
    from ..model.lm import FibLM
    folder = Path(path)
    meta = read_meta(folder)
    weights = read_verified(folder, WEIGHTS, meta)
    tokenizer = _tokenizer(folder, meta)
    mcfg = _model_config(meta, folder)
    check_keys("model_overrides", model_overrides or {}, ("reach", "backend", "max_seq_len"))
    for key, value in (model_overrides or {}).items():
        setattr(mcfg, key, value)
    check_honoured(RunConfig(model=mcfg), {f"model.{k}": f"model_overrides {k}" for k in model_overrides or {}})
    validate_model(mcfg)
    try:
        tensors = st_load(weights)
    except SafetensorError as exc:
        raise ExportError(f"{folder}: file {WEIGHTS} is corrupted (not a safetensors file: {exc})") from None
    model = FibLM(mcfg)
    load_checked(model, tensors, file=f"{folder}: file {WEIGHTS}", described=f"its {CONFIG}", error=ExportError)
    model.to(torch.device(device)).eval()
    return Pretrained(model, mcfg, tokenizer, meta)


def is_run_or_checkpoint(path) -> bool:
    p = Path(path)
    return (p / "checkpoints").is_dir() or (p / "meta.json").is_file()


def from_pretrained(path, *, device="cpu", model_overrides: dict | None = None):
    """The :class:`fibattn.model.lm.FibLM` of an export folder, or of the newest verified checkpoint of a
    training run / a checkpoint folder (eval mode); ``.tokenizer`` is attached."""
    if not is_export(path) and is_run_or_checkpoint(path):
        from .runs import load_run
        items = [f"model.{k}={v}" for k, v in (model_overrides or {}).items()]
        model, _cfg, tokenizer = load_run(path, device=device, model_overrides=items)
    else:
        bundle = load_pretrained(path, device=device, model_overrides=model_overrides)
        model, tokenizer = bundle.model, bundle.tokenizer
    model.tokenizer = tokenizer
    return model


def load_model(path, *, step="latest", device="cpu", model_overrides: list[str] | None = None):
    """``(model, tokenizer)`` from an export folder or a training run / checkpoint folder.

    ``model_overrides``: ``"model.KEY=VALUE"`` strings for the runtime keys (``reach``, ``backend``,
    ``max_seq_len``), as ``fibattn generate --set`` takes them."""
    if is_export(path):
        if step != "latest":
            raise UsageError(f"{path} is an export folder (one fixed step); step must be 'latest', got {step!r}")
        from ..config import RunConfig, apply_overrides
        parsed = apply_overrides(RunConfig(), list(model_overrides or []))
        keys = [item.split("=", 1)[0].strip() for item in model_overrides or []]
        bad = [k for k in keys if not k.startswith("model.")]
        if bad:
            raise UsageError(f"model_overrides (generate --set) may only set model.reach, model.backend, model.max_seq_len, "
                             f"got {bad[0]!r}")
        overrides = {k[len("model."):]: getattr(parsed.model, k[len("model."):]) for k in keys}
        bundle = load_pretrained(path, device=device, model_overrides=overrides)
        return bundle.model, bundle.tokenizer
    from .runs import load_run
    model, _cfg, tokenizer = load_run(path, step=step, device=device, model_overrides=model_overrides)
    return model, tokenizer
