"""``fibattn bench attention|train|generate``: side-by-side speed ratios (never timed tests)."""
from __future__ import annotations

import importlib

SUITES = {
    "attention": "fibattn.bench.attention",
    "train": "fibattn.bench.train",
    "generate": "fibattn.bench.generate",
}


def configure_parser(parser) -> None:
    sub = parser.add_subparsers(dest="suite", metavar="SUITE")
    sub.required = True
    for name, module in SUITES.items():
        p = sub.add_parser(name, help=f"benchmark {name}")
        try:
            importlib.import_module(module).configure_parser(p)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("fibattn"):
                raise
        p.set_defaults(_suite_module=module)


def run(args) -> int:
    return importlib.import_module(args._suite_module).run(args)
