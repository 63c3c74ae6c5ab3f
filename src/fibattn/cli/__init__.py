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
import threading
import traceback

import torch

from .. import __version__
from ..checks import UsageError
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
    "bench": (bench, "benchmarks: attention, train, generate, hf-cache, context-parallel"),
    "config": (show_config, "every --set key with its value, allowed values and help, for a preset or a config "
                            "file (JSON or TOML)"),
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


def _setting_of(args, exc: OSError) -> str | None:
    """The flag or argument whose path holds the one an OSError names (longest match), so that a refused
    write names the setting to change as well as the path; None when the message names one already."""
    if not isinstance(exc.filename, (str, os.PathLike)) or "(" in str(exc.strerror or ""):
        return None
    target, best = os.path.abspath(exc.filename), None
    candidates = []                                 # (setting, path): flags, positionals, --set KEY=PATH items
    for name, value in vars(args).items():
        if name.startswith("_") or name == "command":
            continue
        if isinstance(value, str) and value:
            candidates.append((_POSITIONAL.get(name, "--" + name.replace("_", "-")), value))
        elif isinstance(value, list):
            candidates += [tuple(v.split("=", 1)) for v in value if isinstance(v, str) and "=" in v]
    for setting, value in candidates:
        root = os.path.abspath(value.strip()) if value.strip() else None
        inside = root is not None and (target == root or target.startswith(root.rstrip(os.sep) + os.sep))
        if inside and (best is None or len(root) > len(best[1])):
            best = (setting.strip(), root)
    return None if best is None else best[0]


_POSITIONAL = {"run": "RUN", "run_dir": "RUN", "out_dir": "OUT", "grid": "NAME"}     # metavars of positionals


def _out_of_memory(exc: Exception) -> bool:
    """An allocation the machine refused: Python's, a CUDA device's, or torch's CPU allocator's RuntimeError."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


class _HeldLog(logging.StreamHandler):
    """stderr logging that holds its first lines for ``HOLD_S`` seconds: a command refused for its input
    in that time prints its one error line alone, without the notes (``backend auto -> cpu``) logged
    while the input was read; otherwise the held lines come out then, in order."""

    HOLD_S = 2.0

    def __init__(self):
        super().__init__(sys.stderr)
        self.held: list | None = []
        self.timer = threading.Timer(self.HOLD_S, self.let_go)
        self.timer.daemon = True
        self.timer.start()

    def emit(self, record):
        with self.lock:
            if self.held is not None:
                self.held.append(record)
                return
        super().emit(record)

    def let_go(self, keep: bool = True) -> None:        # (release() is the lock's)
        self.timer.cancel()
        with self.lock:                    # a record logged meanwhile waits: the held ones come out first
            held, self.held = self.held or [], None
            for record in held if keep else ():
                super().emit(record)


def _start_logging(verbose: bool) -> _HeldLog | None:
    root = logging.getLogger()
    if root.handlers:                      # someone configured logging already (tests, an embedding program)
        return None
    handler = _HeldLog()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    return handler


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:              # --help (0) or a bad argument (2, already printed as one line)
        return exc.code if isinstance(exc.code, int) else 2
    held = _start_logging(args.verbose)
    # a command that streams to stdout (generate) lets the held notes out first: on a terminal,
    # stderr lines released mid-stream would land inside the text
    args._logs_before_output = held.let_go if held is not None else (lambda: None)
    try:
        code = _run(args, held)
    finally:
        if held is not None:
            held.let_go()                 # lines held from a run that did not refuse its input
    return code


def _run(args, held: _HeldLog | None) -> int:
    try:
        return int(args._module.run(args) or 0)
    except UsageError as exc:              # bad input (ConfigError, ExportError, ...); a plain ValueError is a bug
        if held is not None:
            held.let_go(keep=False)       # the error line alone
        print(f"fibattn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:                # stdout closed early (``fibattn config | head``): not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as exc:                 # the file system refused: one line naming the path, never a traceback
        if held is not None:
            held.let_go(keep=False)
        print(f"fibattn {args.command}: error: {os_error_line(exc, _setting_of(args, exc))}", file=sys.stderr)
        return 1 if exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT) else 2
    except KeyboardInterrupt:
        print("fibattn: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:               # not bad input: a bug; keep the traceback and say so where it arose
        if _out_of_memory(exc):            # past the size checks' lower bounds: a resource, not a bug
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            print(f"fibattn {args.command}: error: out of memory ({why}); lower the sizes asked for",
                  file=sys.stderr)
            return 1
        if held is not None:
            held.let_go()                 # what was logged before the traceback, in order
        traceback.print_exc()
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"fibattn {args.command}: internal error (a bug in fibattn, not your input; please report it): "
              f"{type(exc).__name__} at {where.filename}:{where.lineno}", file=sys.stderr)
        return 1
