"""``fibattn prepare``: tokenise a preset's data sources into a prepared folder.

    fibattn prepare [--preset tiny|paper] [--set data.field=value ...] [--out DIR] [--force]
    fibattn prepare --files PATH [PATH ...] [--include GLOB] [--exclude GLOB] [--tokenizer byte|bpe|FILE] [--out DIR]
    fibattn prepare --verify DIR

``--verify DIR`` re-hashes an existing folder and builds nothing, so it takes none of
``--preset``, ``--set``, ``--out`` or ``--force`` (given together they are an error, never
silently ignored).

Your own text: ``--files`` (one source per file or folder, stored as absolute paths) or, for
every source option, JSON: ``--set 'data.sources=[{"name":"mine","kind":"files","path":"corpus/"}]'``.
A folder contributes every text file (by content, any name) and .jsonl/.parquet rows; what it skips
(hidden, binary, left out by ``--include`` / ``--exclude`` globs) is said on stderr.
Own sources without ``--out`` go to ``data/NAME``, never into the preset's folder.
The Python API is :func:`fibattn.data.prepare` / :func:`fibattn.data.ensure_prepared`.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..config import ConfigError, apply_overrides
from ..data.manifest import read_manifest
from ..data.pipeline import prepare, verify_prepared
from ..data.sources import files_sources
from ..files import check_creatable
from ..presets import PRESETS, get_preset
from ..validation import check_honoured, given_by_set


def configure_parser(p) -> None:
    p.add_argument("--preset", default=None, help=f"config preset ({' | '.join(PRESETS)}; default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="data.FIELD=VALUE",
                   help="override a config field (repeatable), e.g. --set data.val_fraction=0.05")
    p.add_argument("--files", nargs="+", default=None, metavar="PATH",
                   help="your own text: text files (any name), .jsonl/.parquet files or folders, one source each "
                        "(replaces the preset's sources; then train with --data DIR)")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="with --files: a folder contributes only files matching a glob (path under the folder or "
                        "name; repeatable or comma-separated), e.g. --include '*.md,*.py'")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="with --files: leave out a folder's files or subfolders matching a glob, e.g. "
                        "--exclude 'build,*.min.js'")
    p.add_argument("--tokenizer", default=None, metavar="byte|bpe|FILE",
                   help="data.tokenizer (default: the preset's): bytes, a BPE trained on the data, or a pretrained "
                        "tokenizer.json (or a model folder holding one) to reuse, e.g. the model --init-from starts")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="data.vocab_size of a bpe tokenizer (default: the preset's)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: the preset's data.out_dir; with --files, data/NAME)")
    p.add_argument("--force", action="store_true",
                   help="rebuild the folder even if it exists (a prepared folder only, whatever its config)")
    p.add_argument("--verify", default=None, metavar="DIR",
                   help="re-hash every file of a prepared folder against its manifest, then exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _summary(folder, seconds: float) -> str:
    m = read_manifest(folder)
    lines = [f"prepared {folder} in {seconds:.1f}s: tokenizer={m['tokenizer']['name']} "
             f"vocab_size={m['vocab_size']} dtype={m['dtype']} train_tokens={m['train_tokens']}"]
    for s in m["sources"]:
        lines.append(f"  {s['name']}: docs={s['docs']} tokens={s['tokens']} train={s['train_tokens']} "
                     f"({len(s['shards'])} shards) val={s['val_tokens']} -> {s['val']['file']}")
    return "\n".join(lines)


def _globs(values, flag: str) -> list[str]:
    out = [g.strip() for v in values for g in v.split(",") if g.strip()]
    if values and not out:
        raise ConfigError(f"{flag} needs a glob, e.g. {flag} '*.md', got {values[0]!r}")
    return out


def _verify_conflicts(args) -> list[str]:
    given = [("--preset", args.preset is not None), ("--set", bool(args.overrides)), ("--out", args.out is not None),
             ("--force", args.force), ("--files", args.files is not None), ("--tokenizer", args.tokenizer is not None),
             ("--vocab-size", args.vocab_size is not None), ("--include", bool(args.include)),
             ("--exclude", bool(args.exclude))]
    return [flag for flag, on in given if on]


def run(args) -> int:
    if args.verify is not None:
        conflicts = _verify_conflicts(args)
        if conflicts:
            raise ConfigError(f"--verify DIR checks an existing prepared folder and builds nothing; it cannot be "
                              f"combined with {', '.join(conflicts)} (run the prepare and the verify as two commands)")
        if not args.verify:
            raise ConfigError("--verify needs a folder: --verify DIR (a prepared data folder)")
        t0 = time.perf_counter()
        rep = verify_prepared(args.verify)
        print(f"verified {rep['folder']}: {rep['files']} shard files, {rep['tokens']} tokens, all checksums "
              f"match ({time.perf_counter() - t0:.1f}s)")
        return 0
    foreign = [o.split("=", 1)[0].strip() for o in args.overrides if not o.strip().startswith("data.")]
    if foreign:
        raise ConfigError(f"--set {foreign[0]}: prepare takes data.* settings only (its other settings belong to "
                          f"`fibattn train`)")
    cfg = get_preset(args.preset or "tiny")
    preset_out, preset_sources = cfg.data.out_dir, list(cfg.data.sources)
    include, exclude = _globs(args.include, "--include"), _globs(args.exclude, "--exclude")
    if (include or exclude) and args.files is None:
        raise ConfigError(f"{'--include' if include else '--exclude'} chooses what a --files folder contributes; "
                          f"give --files DIR (or set include / exclude in data.sources)")
    if args.files is not None:
        cfg.data.sources = files_sources(args.files, include=include, exclude=exclude)
    if args.tokenizer is not None:
        known = args.tokenizer in ("byte", "bpe")
        cfg.data.tokenizer = args.tokenizer if known else str(Path(args.tokenizer).expanduser().absolute())
        f = Path(cfg.data.tokenizer)
        if not known and not (f.is_file() or (f / "tokenizer.json").is_file()):
            raise ConfigError(f"--tokenizer must be byte, bpe, or a tokenizer.json file (or a folder holding one), "
                              f"got {args.tokenizer!r}")
    if args.vocab_size is not None:
        if not 256 <= args.vocab_size <= 1 << 32:          # named as the flag, not as data.vocab_size
            raise ConfigError(f"--vocab-size must be an integer in [256, {1 << 32}] (a bpe vocabulary holds the 256 "
                              f"bytes), got {args.vocab_size}")
        cfg.data.vocab_size = args.vocab_size
    apply_overrides(cfg, args.overrides)
    flags = {"data.vocab_size": "--vocab-size"} if args.vocab_size is not None else {}
    check_honoured(cfg, {**given_by_set(args.overrides), **flags})
    if args.out is not None:
        cfg.data.out_dir = args.out
    elif cfg.data.out_dir == preset_out and cfg.data.sources != preset_sources:
        name = getattr(cfg.data.sources[0], "name", None) if cfg.data.sources else None
        cfg.data.out_dir = f"data/{name or 'mine'}"            # never the preset's folder for your own text
    cfg.data.out_dir = str(check_creatable(cfg.data.out_dir, "--out" if args.out is not None else "data.out_dir"))
    t0 = time.perf_counter()
    try:
        folder = prepare(cfg.data, progress=not args.quiet, force=args.force)
    except ImportError as exc:           # an optional package a source or tokenizer needs: one line, exit 2
        raise ConfigError(" ".join(str(exc).split())) from None
    print(_summary(folder, time.perf_counter() - t0))
    return 0
