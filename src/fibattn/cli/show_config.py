"""``fibattn config``: every ``--set`` key with its value, type, allowed values and one-line help, for a
preset or a saved config.

    fibattn config [KEY ...] [--preset tiny|paper | --config FILE.json|FILE.toml] [--set KEY=VALUE ...] [--json]

What ``train`` would use, overrides applied and validated; nothing is written. ``KEY``: show only the keys
that contain it (``fibattn config warmup``). The help and the allowed values are the fields' own
(``config.setting``), the ones validation checks.
"""
from __future__ import annotations

import dataclasses
import json
import typing

from .. import config as C
from ..checks import did_you_mean
from ..config import ConfigError
from ..config_files import load_all
from ..presets import PRESETS, get_preset
from ..validation import check_honoured, given_by_file, given_by_set, recorded, validate_given


def configure_parser(parser) -> None:
    parser.add_argument("--preset", default=None, help=f"{' | '.join(PRESETS)} (default tiny)")
    parser.add_argument("keys", nargs="*", metavar="KEY", help="show only the keys containing KEY (e.g. warmup)")
    parser.add_argument("--config", action="append", default=None, metavar="FILE.json|FILE.toml",
                        help="a config file, JSON (e.g. a run's config.json) or TOML; keys it leaves out keep the "
                             "preset-free defaults; repeat to merge several in order, as in train")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, as in train")
    parser.add_argument("--json", action="store_true", help="print the config as JSON instead of KEY = VALUE lines")


def rows(cfg) -> list[tuple[str, str, str, str]]:
    """``(key, value as JSON, type and allowed values, help)`` for every settable field, in declaration
    order; each source's fields follow ``data.sources`` as ``data.sources[i].FIELD`` (``--set`` keys too)."""
    out = []

    def walk(obj, prefix):
        for name, kind in typing.get_type_hints(type(obj)).items():
            value = getattr(obj, name)
            key = f"{prefix}{name}"
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.")
                continue
            shown = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value] \
                if isinstance(value, list) else value
            text, choices = C.field_help(type(obj), name)
            kind = getattr(kind, "__name__", str(kind))
            out.append((key, json.dumps(shown), f"{kind}: {' | '.join(choices)}" if choices else kind, text))
            if name == "sources":
                for i, src in enumerate(value):
                    if dataclasses.is_dataclass(src):
                        walk(src, f"{key}[{i}].")

    walk(cfg, "")
    return out


def run(args) -> int:
    if args.config and args.preset:
        raise ConfigError("give either --preset or --config, not both")
    cfg, origins = load_all(args.config) if args.config else (get_preset(args.preset or "tiny"), {})
    validate_given(C.apply_overrides(cfg, args.set), origins, args.set)
    check_honoured(cfg, {**given_by_file(cfg, origins), **given_by_set(args.set)})
    if args.json:                       # what a run records: reusable as a --config file
        print(json.dumps(recorded(cfg), indent=2, sort_keys=True))
        return 0
    table = rows(cfg)
    for want in args.keys:
        if not any(want in key for key, *_ in table):
            names = {w for k, *_ in table for w in [k.rsplit(".", 1)[-1], *k.rsplit(".", 1)[-1].split("_")]}
            raise ConfigError(f"no config key contains {want!r}{did_you_mean(want, names)} (`fibattn config` "
                              f"lists every key)")
    if args.keys:
        table = [row for row in table if any(want in row[0] for want in args.keys)]
    w, vw = max(len(k) for k, *_ in table), min(24, max(len(v) for _, v, *_ in table))
    for key, value, kind, text in table:
        print(f"{key:<{w}} = {value:<{vw}}  ({kind})  # {text}".rstrip(" #"))
    return 0
