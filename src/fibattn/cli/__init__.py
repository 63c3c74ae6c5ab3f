"""``fibattn`` command line: one module per command in this package.

Each command module defines ``configure_parser(parser)`` and ``run(args) -> int``; they are
imported directly, so a broken import fails loudly. Bad input exits with status 2 and a
one-line error naming the field.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

import torch

from .. import __version__
from ..files import os_error_line
from . import bench, demo, evaluate, export, generate, grid, prepare, probe, report, show_config, train

COMMANDS = {
    "demo": (demo, "train and evaluate the demo grid on the bundled corpus (CPU, minutes)"),
    "prepare": (prepare, "tokenise sources into shards"),
    "train": (train, "train a model from a preset plus overrides"),
    "eval": (evaluate, "perplexity across lengths on validation splits"),
    "probe": (probe, "the mechanistic retrieval probe"),
    "grid": (grid, "run an experiment grid"),
    "report": (report, "tables and plots for a grid"),
    "generate": (generate, "stream tokens from a trained model"),
    "export": (export, "write a portable model folder"),
    "bench": (bench, "benchmarks: attention, train, generate, hf-cache"),
    "config": (show_config, "every --set key with its value, for a preset or a saved config"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message`` (no usage block), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fibattn", description="Depth-staggered Fibonacci sparse attention.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", help="print the fibattn and torch versions and exit",
                        version=f"fibattn {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        module.configure_parser(p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:              # --help (0) or a bad argument (2, already printed as one line)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return int(args._module.run(args) or 0)
    except ValueError as exc:              # ConfigError, PathError, CheckpointError, ShardError, ...: bad input
        print(f"fibattn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:                # stdout closed early (``fibattn config | head``): not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as exc:                 # the file system refused: one line naming the path, never a traceback
        print(f"fibattn {args.command}: error: {os_error_line(exc)}", file=sys.stderr)
        return 1 if exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT) else 2
    except KeyboardInterrupt:
        print("fibattn: interrupted", file=sys.stderr)
        return 130
