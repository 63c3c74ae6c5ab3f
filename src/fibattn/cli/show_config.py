"""``fibattn config``: every ``--set`` key with its value and type, for a preset or a saved config.

    fibattn config [--preset tiny|paper | --config FILE.json] [--set KEY=VALUE ...] [--json]

What ``train`` would use, overrides applied and validated; nothing is written.
"""
from __future__ import annotations

import dataclasses
import json
import typing

from .. import config as C
from ..config import ConfigError
from ..presets import PRESETS, get_preset
from ..validation import check_honoured, given_by_set, validate_given


def configure_parser(parser) -> None:
    parser.add_argument("--preset", default=None, help=f"{' | '.join(PRESETS)} (default tiny)")
    parser.add_argument("--config", default=None, metavar="FILE.json", help="a full config (e.g. a run's config.json)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, as in train")
    parser.add_argument("--json", action="store_true", help="print the config as JSON instead of KEY = VALUE lines")


def rows(cfg) -> list[tuple[str, str, str]]:
    """``(key, value as JSON, type)`` for every settable field, in declaration order."""
    out = []

    def walk(obj, prefix):
        for name, kind in typing.get_type_hints(type(obj)).items():
            value = getattr(obj, name)
            key = f"{prefix}{name}"
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.")
            else:
                if isinstance(value, list):
                    value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
                out.append((key, json.dumps(value), getattr(kind, "__name__", str(kind))))

    walk(cfg, "")
    return out


def run(args) -> int:
    if args.config and args.preset:
        raise ConfigError("give either --preset or --config, not both")
    cfg = C.load(args.config) if args.config else get_preset(args.preset or "tiny")
    validate_given(C.apply_overrides(cfg, args.set), args.config, args.set)
    check_honoured(cfg, given_by_set(args.set))
    if args.json:
        print(json.dumps(C.to_dict(cfg), indent=2, sort_keys=True))
        return 0
    table = rows(cfg)
    w = max(len(k) for k, _, _ in table)
    for key, value, kind in table:
        print(f"{key:<{w}} = {value}  ({kind})")
    return 0
