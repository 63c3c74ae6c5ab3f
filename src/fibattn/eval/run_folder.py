"""Evaluating a run folder: load the checkpoint and its validation splits, evaluate, store.

Outputs (all atomic):

- ``RUN/eval.json`` (or ``--json OUT``): merged with what is there; a new result replaces
  the old one with the same ``(dataset, length, mode)``; ``mode`` is the reach
  (``study`` | ``train``), ``dense-window``, or the reach with a RoPE scaling (``study+yarn``,
  ``train+ntk@4``: :func:`fibattn.eval.modes.mode_name`), so every mode's results sit side by side.
  Each result holds ppl, bpb, the scored token count and hash, and the per-position loss buckets.
- the results DB (``eval_results``; default ``<parent of RUN>/results.sqlite``, as the
  trainer's): one row per result, ``reach`` column = ``mode``, the rest of the record as JSON.
- ``RUN/eval_positions_<mode>.png``: per-position loss, one panel per dataset, one line per length.
- learned schedules: ``RUN/alphas.md`` and ``RUN/alphas.png`` (:mod:`fibattn.eval.alpha_report`).

The command is ``fibattn eval`` (:mod:`fibattn.cli.eval`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from ..checks import UsageError, check_int
from . import perplexity as E
from .modes import SCALING_KINDS, check_factor, resolve_mode
from ..devices import resolve_device
from ..data.loader import masking_eos
from ..files import atomic_write_text, check_creatable, naming_os_errors
from ..storage.runs import EVAL_JSON, read_eval_doc

log = logging.getLogger("fibattn")


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        chosen = "bf16" if device.type == "cuda" else "fp32"
        E._log_once("fibattn eval: --precision auto -> %s on %s", chosen, device.type)
        return chosen
    if precision not in ("fp32", "bf16"):
        raise UsageError(f"--precision must be auto, fp32 or bf16, got {precision!r}")
    return precision


def run_folder(path) -> Path:
    """The run folder of ``path`` (a run folder, or one of its ``checkpoints/step-N`` folders)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"run folder {p} does not exist")
    if not p.is_dir():
        raise UsageError(f"run {p} is not a folder")
    if p.parent.name == "checkpoints" and (p / "meta.json").is_file():
        return p.parent.parent
    return p


def open_data(data, cfg):
    """A ``TokenData``-like object: ``data`` itself, a folder path, or the run's ``data.out_dir``."""
    from ..data import TokenData
    if data is not None and not isinstance(data, (str, Path)):
        return data
    path = Path(data) if data is not None else Path(cfg.data.out_dir)
    if not path.is_dir():
        where = "--data" if data is not None else "the run's data.out_dir"
        raise FileNotFoundError(f"validation data not found at {path} ({where}); pass --data DIR, the prepared "
                                f"data folder (fibattn prepare)")
    return TokenData(path)


def pick_datasets(names, available: list[str]) -> list[str]:
    if not names:
        return list(available)
    bad = [n for n in names if n not in available]
    if bad:
        raise UsageError(f"unknown dataset {bad[0]!r} for --datasets (validation splits: {', '.join(available)})")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- outputs
def read_json_target(path) -> dict | None:
    """The eval document already at ``path`` (validated; None when absent), or a ValueError naming it."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UsageError(f"{path} exists and is not a file; pass --json OUT to write the results elsewhere")
    try:
        return read_eval_doc(path)
    except ValueError as exc:
        raise UsageError(f"{exc}; move it away or pass --json OUT") from None


def merge_json(path, run: str, step, report: E.EvalReport, extra: dict | None = None) -> dict:
    """Merge ``report`` into the JSON file at ``path`` (atomic); returns the merged document."""
    path = Path(path)
    doc = read_json_target(path) or {"format": 1, "run": run, "results": []}
    new = {(r.dataset, r.length, r.mode): {**asdict(r), "step": step} for r in report.records}
    kept = [r for r in doc["results"] if (r.get("dataset"), r.get("length"), r.get("mode")) not in new]
    doc["results"] = sorted(kept + list(new.values()), key=lambda r: (r["dataset"], r["mode"], r["length"]))
    doc["run"] = run
    doc.setdefault("datasets", {}).update(report.datasets)
    doc["last_settings"] = {**report.settings, "step": step}
    doc.update(extra or {})
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


DB_SETTING = "--db / train.results_db"


def check_db(db_path) -> None:
    """Prove the results database is intact and writable before anything is evaluated."""
    from ..storage.results import check_db_path
    db = check_db_path(db_path, DB_SETTING)
    if db is not None:
        db.close()


def log_to_db(db_path, run: str, step, report: E.EvalReport) -> None:
    from ..storage.results import ResultsDB
    with ResultsDB(db_path, setting=DB_SETTING) as db:
        for r in report.records:
            extra = {k: v for k, v in asdict(r).items() if k not in ("ppl", "bpb", "tokens")}
            db.log_eval(run, r.dataset, r.length, r.mode, ppl=r.ppl, bpb=r.bpb, tokens=r.tokens,
                        extra={**extra, "step": step})


def plot_positions(report: E.EvalReport, path, title: str) -> Path:
    from ..plots import Panel, Series, save_panels
    panels = []
    for name in report.datasets:
        series = []
        for r in (r for r in report.records if r.dataset == name):
            xs = [(b["start"] + b["end"]) / 2 for b in r.buckets]
            series.append(Series(f"L={r.length}", xs, [b["loss"] for b in r.buckets], marker="."))
        panels.append(Panel(name, "position in window", "mean loss (nats)", series))
    return save_panels(path, panels, suptitle=title)


def _db_path(db: str, run_dir: Path, cfg):
    from ..storage.results import resolve_db_path
    if db:
        return resolve_db_path(run_dir, db)
    return resolve_db_path(run_dir, cfg.train.results_db)


# ----------------------------------------------------------------------------- API
def evaluate_run(run_dir, *, step="latest", lengths=None, datasets=None, tokens=None, reach=None,
                 batch_size=None, device: str | None = None, precision: str = "auto",
                 data=None, json_out=None, db: str = "", plot: bool = True, buckets: int = 32,
                 alpha_report: bool = True, mode: str | None = None, rope_factor: float | None = None, document_masking: bool | None = None,
                 context_parallel: int = 1) -> E.EvalReport:
    """Evaluate a run folder's checkpoint; settings default to the run's ``eval`` config.

    ``mode``: ``none | linear | ntk | yarn | window`` (:mod:`fibattn.eval.modes`; ``fibattn eval
    --mode``, the one option for this choice). Each mode's results are stored under their own name (``report.settings["mode"]``), beside the others.

    ``db``: ``""`` (the run's results DB), a path, or ``"off"``. ``data``: a prepared
    data folder or ``TokenData`` (default: the run's ``data.out_dir``). ``device``:
    ``auto | cpu | cuda | cuda:N`` (default: the run's ``train.device``). ``document_masking``
    (default: the run's ``eval.document_masking``): score each document of a window on its own.
    ``context_parallel``: under torchrun, this many processes share each window (method.md §9); the
    first one writes the results.
    """
    from ..parallel.context import joined
    check_int("--context-parallel", context_parallel, 1)
    dev = resolve_device(device) if device is not None else None      # a bad --device fails before joining
    with joined(context_parallel, device=dev) as context:
        return _evaluate_run(run_dir, step, lengths, datasets, tokens, reach, batch_size, device,
                             precision, data, json_out, db, plot, buckets, alpha_report, mode,
                             rope_factor, document_masking, context)


def _evaluate_run(run_dir, step, lengths, datasets, tokens, reach, batch_size, device, precision,
                  data, json_out, db, plot, buckets, alpha_report, mode, rope_factor, document_masking,
                  context) -> E.EvalReport:
    from . import alpha_report as A
    from .. import plots
    from ..storage.checkpoint import Checkpoint
    from ..storage.results import run_key
    from ..storage.pretrained import is_export
    from ..storage.runs import find_checkpoint, load_run
    folder = run_folder(run_dir)
    if lengths is not None:
        E.check_lengths(lengths)
    if reach is not None and reach not in E.REACH_MODES:
        raise UsageError(f"--reach must be one of {', '.join(E.REACH_MODES)}, got {reach!r}")
    kind = resolve_mode(mode)                                                           # bad modes fail first
    if rope_factor is not None:
        check_factor(rope_factor, "--rope-factor")
        if kind not in SCALING_KINDS[1:]:
            raise UsageError(f"--rope-factor applies to the RoPE scaling modes ({', '.join(SCALING_KINDS[1:])}), "
                             f"not to mode {kind!r}; got {rope_factor!r}")
    if device is not None:
        resolve_device(device)                                   # a bad --device fails before loading
    if is_export(folder):
        model, cfg, tokenizer, ck_step, tok_file = _load_export(folder, step, data)
    else:
        ckpt = find_checkpoint(run_dir, step)                    # verified once: this folder is what is evaluated
        model, cfg, tokenizer = load_run(ckpt, device="cpu")
        ck_step, tok_file = Checkpoint.open(ckpt).step, ckpt / "tokenizer.json"
    json_path = Path(json_out) if json_out else folder / EVAL_JSON
    writer = context is None or context.rank == 0                # one process of a context group writes
    if writer:
        check_creatable(json_path, "--json" if json_out else "the run's eval.json", "file")
        read_json_target(json_path)                              # a damaged eval.json fails before the work
    db_path = _db_path(db, folder, cfg)
    if db_path is not None and writer:
        check_db(db_path)                                        # so does a corrupted or read-only database
    dev = resolve_device(device if device is not None else cfg.train.device)
    prec = resolve_precision(precision, dev)
    model.to(dev)
    ev = cfg.eval
    td = open_data(data, cfg)
    _check_data_matches(td, cfg, tok_file)
    names = pick_datasets(datasets if datasets is not None else ev.datasets, list(td.val_names))
    report = E.evaluate(model, {n: td.val_tokens(n) for n in names}, lengths or ev.lengths,
                        tokens=tokens if tokens is not None else ev.tokens, reach=reach or ev.reach,
                        batch_size=batch_size if batch_size is not None else ev.batch_size,
                        mode=kind, rope_factor=rope_factor, tokenizer=tokenizer or getattr(td, "tokenizer", None),
                        buckets=buckets, precision=prec,
                        document_eos=masking_eos(ev.document_masking if document_masking is None else document_masking,
                                                 td, "eval.document_masking (--document-masking)"),
                        context=context)
    run = run_key(folder)
    report.settings.update(run=run, step=ck_step, run_dir=str(folder))
    if not writer:
        return report
    extra = {}
    if alpha_report and A.is_learned(cfg.model) and not is_export(folder):
        ar = A.report_for_run(folder, model, cfg, db_path=_db_path(db, folder, cfg), end_step=ck_step)
        A.write_report(ar, folder, plot=plot)
        extra["alphas"] = ar.to_dict()
        report.settings["alpha_report"] = ar.markdown()
    with naming_os_errors(json_path, "--json" if json_out else "the run's eval.json"):
        merge_json(json_path, run, ck_step, report, extra)
    report.settings["json"] = str(json_path)
    if db_path is not None:
        log_to_db(db_path, run, ck_step, report)
    if plot:
        if plots.available():
            mode = report.settings["mode"]
            png = folder / f"eval_positions_{mode}.png"
            with naming_os_errors(png, "the run folder"):
                plot_positions(report, png, f"{run} (step {ck_step}), {mode}")
            report.settings["plot"] = str(png)
        else:
            plots.warn_unavailable("the per-position loss plot")
    return report


def _load_export(folder: Path, step, data):
    """``(model, cfg, tokenizer, step, folder)`` of an export folder. An export records the model and the
    run's evaluation settings, not its data: ``--data`` is required; lengths, tokens and batch size default
    to the run's (exports written before they were recorded: 1× and 4× the training length), and no
    results database is written unless ``--db`` names one."""
    from ..config import ConfigError, RunConfig, from_dict
    from ..storage.pretrained import ExportError, load_pretrained
    from ..validation import validate_eval
    if step != "latest":
        raise UsageError(f"{folder} is an export folder (one fixed step); --step must be 'latest', got {step!r}")
    if data is None:
        raise UsageError(f"{folder} is an export, which records no data folder: pass --data DIR (a folder from "
                         f"`fibattn prepare` with the export's tokenizer)")
    bundle = load_pretrained(folder)
    cfg = RunConfig(name=folder.name, model=bundle.model_config)
    saved = bundle.meta.get("eval")
    if saved is None:
        cfg.eval.lengths = [bundle.model_config.seq_len, 4 * bundle.model_config.seq_len]
    else:
        try:
            cfg.eval = from_dict({"eval": dict(saved)}).eval
            validate_eval(cfg.eval)
        except (ConfigError, TypeError, ValueError) as exc:
            raise ExportError(f"{folder}: config.json field 'eval' is not a valid fibattn eval config "
                              f"({exc})") from None
    cfg.train.results_db, cfg.train.device = "off", "auto"
    source_step = (bundle.meta.get("source") or {}).get("step")
    # the run's own tokenizer file (exports before fibattn_tokenizer.json named it tokenizer.json)
    tok_file = folder / (bundle.meta.get("tokenizer") or "tokenizer.json")
    return bundle.model, cfg, bundle.tokenizer, source_step, tok_file


def _check_data_matches(td, cfg, ck_tok: Path) -> None:
    """The validation data must use the run's tokenizer (``ck_tok``: the checkpoint's or export's copy of the
    run's file) and fit its vocabulary."""
    from ..data.tokenizers import tokenizer_sha256
    vocab = getattr(td, "vocab_size", None)
    if vocab is not None and vocab > cfg.model.vocab_size:
        raise UsageError(f"--data {getattr(td, 'path', '')}: its vocabulary ({vocab}) is larger than the model's "
                         f"model.vocab_size ({cfg.model.vocab_size}); evaluate on data prepared with the run's "
                         f"tokenizer")
    want = ((getattr(td, "manifest", None) or {}).get("tokenizer") or {}).get("sha256")
    if want and ck_tok.is_file() and tokenizer_sha256(ck_tok) != want:
        raise UsageError(f"--data {getattr(td, 'path', '')}: its tokenizer does not match the run's ({ck_tok}); "
                         f"evaluate on data prepared with the run's tokenizer")
