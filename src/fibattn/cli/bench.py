"""``fibattn bench attention|op|train|generate|hf-cache|hf-generate|context-parallel``: side-by-side speed ratios and cache sizes (see
:mod:`fibattn.bench`)."""
from __future__ import annotations

from ..bench import attention, context_parallel, generate, hf_cache, hf_generate, op_timing, train

SUITES = {"attention": attention, "train": train, "generate": generate, "hf-cache": hf_cache,
          "hf-generate": hf_generate, "op": op_timing, "context-parallel": context_parallel}


def configure_parser(parser) -> None:
    sub = parser.add_subparsers(dest="suite", metavar="SUITE")
    sub.required = True
    for name, module in SUITES.items():
        p = sub.add_parser(name, help=f"benchmark {name}")
        module.configure_parser(p)
        p.set_defaults(_suite=module, _parser=p)


def run(args) -> int:
    return args._suite.run(args)
