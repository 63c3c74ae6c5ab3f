"""``fibattn export RUN OUT/ [--step N] [--force]``: a portable model folder.

Writes ``config.json``, ``model.safetensors``, the run's own tokenizer file (``fibattn_tokenizer.json``, what
fibattn loads and what ``eval --data`` compares with the data's), ``tokenizer.json`` + ``tokenizer_config.json``
(transformers' ``AutoTokenizer``: :mod:`fibattn.data.autotokenizer`) and a ``README.md`` model card (layout:
:mod:`fibattn.storage.pretrained`). Load it back with ``fibattn.from_pretrained(OUT)``.

The folder is built in a hidden staging folder next to ``OUT`` (every file written
atomically, ``config.json`` last) and renamed into place. A non-empty ``OUT`` is refused
unless ``--force``; even with ``--force`` only an earlier export is replaced: the files its
``config.json`` lists (and the config itself) are replaced or removed, every other file or
folder in ``OUT`` is kept, and a file of the user's that the new export would overwrite is
refused. ``OUT`` holding anything but an earlier export is refused.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from safetensors.torch import save as st_save

from .. import __version__
from ..checks import UsageError
from ..data.autotokenizer import hf_tokenizer_files
from ..files import (atomic_write_bytes, atomic_write_text, check_creatable, fsync_dir, make_parents,
                     naming_os_errors)
from . import checkpoint as ck
from . import pretrained as hub
from .runs import EVAL_JSON, read_eval_doc

log = logging.getLogger("fibattn")


# ----------------------------------------------------------------------------- gathering
def _read_run(run_dir, step):
    """``(model, RunConfig, tokenizer, its file's bytes or None, checkpoint Checkpoint)``; verified."""
    from ..data.tokenizers import parse_tokenizer
    from .runs import checkpoint_config, find_checkpoint, load_run
    path = find_checkpoint(run_dir, step)
    c = ck.Checkpoint.open(path)
    cfg = checkpoint_config(c)
    model, _, _ = load_run(path)
    tok, source = None, Path(cfg.data.out_dir) / "tokenizer.json"
    if "tokenizer.json" in c.meta["files"]:
        tok, source = c._read("tokenizer.json"), path / "tokenizer.json"
    elif source.is_file():
        tok = source.read_bytes()
    else:
        log.warning("fibattn export: no tokenizer in %s nor in %s; the export has none", path, cfg.data.out_dir)
    return model, cfg, None if tok is None else parse_tokenizer(tok, source), tok, c


def _data_manifest(cfg) -> dict | None:
    from ..data.manifest import read_manifest
    try:
        return read_manifest(cfg.data.out_dir)
    except (OSError, ValueError):
        return None


def _eval_doc(run_dir) -> dict | None:
    try:
        return read_eval_doc(Path(run_dir) / EVAL_JSON)
    except ValueError as exc:
        log.warning("fibattn export: %s; the model card has no results", exc)
        return None


# ----------------------------------------------------------------------------- model card
def run_card(run_dir, model, cfg, checkpoint, **how) -> str:
    """The model card of ``checkpoint`` of ``run_dir`` (a run or checkpoint folder), with the run's
    data manifest and ``eval.json`` results when they can be read; ``how``: :func:`model_card`'s
    ``load`` snippet and ``files`` line for another folder format."""
    root = Path(run_dir) if not (Path(run_dir) / ck.META).is_file() else checkpoint.path.parent.parent
    return model_card(model, cfg, checkpoint.step, _data_manifest(cfg), _eval_doc(root), **how)


def _architecture_lines(model, m) -> list[str]:
    lines = [f"- parameters: {model.num_params(non_embedding=False):,} "
             f"({model.num_params():,} non-embedding; the output head "
             f"{'is tied to the embedding' if m.tie_embeddings else 'has weights of its own'})",
             f"- d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads / {m.n_kv_heads} kv heads, "
             f"vocabulary {m.vocab_size}, RoPE theta {m.rope_theta:g}, trained at length {m.seq_len}"]
    if m.attention == "dense":
        return lines + ["- attention: dense (full causal)"]
    if m.base == "none":                # the window-only control: alpha places no column
        return lines + [f"- attention: sliding window only (no rungs, base `none`): each query attends distances "
                        f"0..{m.window} ({m.window + 1} columns) in every layer"]
    base = {"fib": f"fib (first {m.base_k} Fibonacci numbers 1, 2, 3, 5, ...)", "pow2": "pow2 (1, 2, 4, ...)",
            "custom": f"custom {list(m.base_values)}"}[m.base]
    lines += [f"- attention: sparse; window W={m.window}, base {base}, schedule `{m.schedule}`, reach `{m.reach}`",
              "", "| layer | alpha | attended distances at the training length |", "|---|---|---|"]
    for i, (a, d) in enumerate(zip(model.alphas(), model.distances(m.seq_len))):
        far = [x for x in d if x > m.window]
        lines.append(f"| {i} | {a:.4f} | 0..{m.window} + {far} |")
    return lines


def _data_lines(cfg, manifest) -> list[str]:
    d, t = cfg.data, cfg.train
    lines = [f"- tokenizer: {d.tokenizer}" + (f" (vocab {manifest['vocab_size']})" if manifest else "")]
    for s in d.sources:
        where = "bundled corpus" if s.kind == "bundled" else f"{s.kind}: {s.path}" + (f" [{s.subset}]" if s.subset else "")
        lines.append(f"- source `{s.name}` ({where}), weight {s.weight:g}")
    if manifest and "train_tokens" in manifest:
        lines.append(f"- prepared training tokens: {manifest['train_tokens']:,}")
    lines.append(f"- training: {t.steps} steps x {t.batch_tokens} tokens, lr {t.lr:g}, seed {t.seed}")
    src = t.init_source or {}
    if t.init_from:                 # a fine-tune: where its starting weights came from
        lines.append(f"- initialised from {src.get('path') or t.init_from} ({src.get('kind', 'weights')}"
                     + (f", step {src['step']}" if src.get("step") is not None else "")
                     + (f", sha256 {src['sha256']}" if src.get("sha256") else "") + ")")
    return lines


def _result_lines(doc) -> list[str]:
    if not doc or not doc["results"]:
        return ["No `eval.json` in the run folder: run `fibattn eval RUN` before exporting to list results here."]
    lines = ["| dataset | length | mode | tokens | ppl | bits/byte | step |", "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        bpb = "—" if r.get("bpb") is None else f"{r['bpb']:.4f}"
        lines.append(f"| {r.get('dataset')} | {r.get('length')} | {r.get('mode')} | {r.get('tokens')} | "
                     f"{r.get('ppl', float('nan')):.3f} | {bpb} | {r.get('step', '?')} |")
    return lines


FIBATTN_LOAD = ["import fibattn", "model = fibattn.from_pretrained(\"PATH\")   # model.tokenizer is attached"]
FIBATTN_FILES = ("`config.json` (model config, versions, sha256 of every file), `model.safetensors` (weights), "
                 "`fibattn_tokenizer.json` (fibattn's), `tokenizer.json` / `tokenizer_config.json` "
                 "(transformers' AutoTokenizer). No pickle: only JSON and safetensors are read when loading.")


def _hub_id(path) -> str | None:
    """A Hugging Face hub id for a source path: ``org/name`` from a hub cache folder (``models--org--name``) or a
    relative ``org/name`` that is no local path; None for a local folder (no id to cite)."""
    if not path:
        return None
    for part in Path(path).parts:
        if part.startswith(("models--", "datasets--")) and part.count("--") >= 2:
            return "/".join(part.split("--")[1:])
    ok = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path))
    return str(path) if ok and not Path(path).expanduser().exists() else None


def card_metadata(cfg, *, library: str = "fibattn", tags=()) -> list[str]:
    """The model card's YAML front matter, which model hubs read: library, pipeline, tags, the base model of a
    fine-tune or retrofit (when its hub id is known) and the hub datasets it was trained on (values as JSON
    strings, which YAML reads as they are). No license: fibattn cannot know the one the weights carry."""
    src = cfg.train.init_source or {}
    base = _hub_id(src.get("path") or cfg.train.init_from) if cfg.train.init_from else None
    datasets = [d for d in dict.fromkeys(_hub_id(s.path) for s in cfg.data.sources if s.kind == "hf") if d]
    tag_list = ["fibattn", "sparse-attention" if cfg.model.attention == "sparse" else "dense-attention",
                "text-generation", *tags]
    lines = ["---", f"library_name: {library}", "pipeline_tag: text-generation", "tags:",
             *[f"- {json.dumps(t)}" for t in tag_list]]
    if base:
        lines.append(f"base_model: {json.dumps(base)}")
    if datasets:
        lines += ["datasets:", *[f"- {json.dumps(d)}" for d in datasets]]
    return lines + ["---", ""]


def model_card(model, cfg, step: int, manifest, eval_doc, *, load=FIBATTN_LOAD, files=FIBATTN_FILES,
               library: str = "fibattn", tags=()) -> str:
    parts = [*card_metadata(cfg, library=library, tags=tags), f"# fibattn model: {cfg.name} (step {step})", "",
             "A decoder language model with depth-staggered Fibonacci sparse attention, exported by "
             f"fibattn {__version__}. Load it with:", "", "```python", *load, "```", "",
             "## Architecture", "", *_architecture_lines(model, cfg.model), "",
             "## Data", "", *_data_lines(cfg, manifest), "",
             "## Results", "", *_result_lines(eval_doc), "",
             "## Files", "", files, ""]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- writing
def _previous_listing(out: Path) -> set[str]:
    """The files an earlier export in ``out`` consists of (its ``config.json`` listing plus the config itself);
    a ValueError naming the folder when ``out`` does not hold a readable earlier export."""
    try:
        meta = hub.read_meta(out)
    except hub.ExportError as exc:
        raise UsageError(f"OUT {out} is not empty and is not a readable fibattn export ({exc}); refusing to "
                         f"replace anything in it even with --force (choose an empty or new folder)") from None
    names = set(meta["files"]) | {hub.CONFIG}
    for name in sorted(names):
        p = out / name
        if p.is_symlink() or (p.exists() and not p.is_file()):
            raise UsageError(f"OUT {out}: {name}, listed by the earlier export's {hub.CONFIG}, is not a plain file; "
                             f"refusing to replace it (move it away or choose another folder)")
    return names


def _check_target(out: Path, force: bool) -> set[str]:
    """Check ``out`` can be written; returns the earlier export's files that may be replaced (empty if none)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UsageError(f"OUT {out} is not empty; pass --force to replace an earlier export")
        if not hub.is_export(out):
            raise UsageError(f"OUT {out} is not empty and is not a fibattn export; refusing to replace it even "
                             f"with --force (choose an empty or new folder)")
        return _previous_listing(out)
    return set()


def _write_folder(stage: Path, model, cfg, step: int, tokenizer, tok: bytes | None, card: str,
                  source: dict) -> None:
    files: dict = {}

    def put(name: str, data: bytes) -> None:
        atomic_write_bytes(stage / name, data)
        files[name] = {"sha256": hub.sha256_bytes(data), "bytes": len(data)}

    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    put(hub.WEIGHTS, st_save(state, metadata={"format": "pt", "fibattn_format": str(hub.FORMAT)}))
    if tok is not None:
        put(hub.FIBATTN_TOKENIZER, tok)
        for name, data in hf_tokenizer_files(tokenizer).items():
            put(name, data)
    put(hub.CARD, card.encode("utf-8"))
    from ..config import to_dict
    meta = {"fibattn_format": hub.FORMAT, "fibattn_version": __version__, "model_type": "fibattn",
            "model": to_dict(cfg.model), "tokenizer": hub.FIBATTN_TOKENIZER if tok is not None else None,
            "eval": to_dict(cfg.eval),            # so `fibattn eval EXPORT` scores what `fibattn eval RUN` does
            "alphas": model.alphas(), "num_params": model.num_params(non_embedding=False),
            "source": source, "files": files}
    atomic_write_text(stage / hub.CONFIG, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    fsync_dir(stage)


def _same_bytes(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def _install(stage: Path, out: Path, previous: set[str]) -> None:
    """Move the staged export into ``out``. A new folder is renamed into place; into an existing one
    only the staged files are moved (each atomically), ``config.json`` last, then the files the earlier
    export listed that the new one lacks are removed. Nothing else in ``out`` is touched."""
    if not out.exists():
        os.replace(stage, out)
        fsync_dir(out.parent)
        return
    new = sorted(p.name for p in stage.iterdir() if p.is_file())
    for name in new:              # a file of the user's in the way: refuse before changing anything
        target = out / name
        in_way = name not in previous and (target.exists() or target.is_symlink())
        if in_way and not (target.is_file() and not target.is_symlink() and _same_bytes(target, stage / name)):
            raise UsageError(f"OUT {out}: {name} is not part of the earlier export (its {hub.CONFIG} does not "
                             f"list it) and the new export would overwrite it; move it away or choose another "
                             f"folder")
    for name in new:
        if name != hub.CONFIG:
            os.replace(stage / name, out / name)
    os.replace(stage / hub.CONFIG, out / hub.CONFIG)
    for name in sorted(previous - set(new)):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    fsync_dir(out)
    shutil.rmtree(stage, ignore_errors=True)


def export_run(run_dir, out_dir, *, step="latest", force: bool = False) -> Path:
    """Write the portable folder ``out_dir`` from ``run_dir`` (a run or checkpoint folder)."""
    out = check_creatable(out_dir, "the export folder (OUT)")
    previous = _check_target(out, force)
    model, cfg, tokenizer, tok, c = _read_run(run_dir, step)
    card = run_card(run_dir, model, cfg, c)
    source = {"run": cfg.name, "step": c.step, "checkpoint_model_sha256": c.meta["files"][ck.MODEL]["sha256"]}
    stage = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with naming_os_errors(out, "the export folder (OUT)"):
        make_parents(out)                     # a new exports/ gets a .gitignore of "*"
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir()
        try:
            _write_folder(stage, model, cfg, c.step, tokenizer, tok, card, source)
            _install(stage, out, previous)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    hub.verify_export(out)
    return out
