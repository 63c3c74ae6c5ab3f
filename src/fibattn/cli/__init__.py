"""``fibattn`` command line: one module per command in this package.

Each command module defines ``configure_parser(parser)`` and ``run(args) -> int``; they are
imported directly, so a broken import fails loudly. Bad input exits with status 2 and a
one-line error naming the field.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
import threading
import traceback

import torch

from .. import __version__
from ..checks import UsageError, float_flag, int_flag
from ..entry import check_text, error_line, out_of_memory, setup_streams, shown
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
    """argparse with one-line errors: ``prog: error: message`` (no usage block), exit status 2; no abbreviated
    flags (``--dat`` is a typo, never ``--data``); every ``type=int`` / ``type=float`` flag range-checked where it
    is parsed (:func:`fibattn.checks.int_flag`: sizes and counts fit 32 bits, numbers are finite)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        if kwargs.get("type") is int:
            kwargs["type"] = int_flag()
        elif kwargs.get("type") is float:
            kwargs["type"] = float_flag()
        return super().add_argument(*names, **kwargs)

    def error(self, message):
        choice = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if choice:                        # a misspelt command or choice: its closest, as for a flag
            close = _closest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            message += f"; did you mean {close}?" if close else ""
        self.exit(2, f"{self.prog}: error: {shown(message)} (see {self.prog} --help)\n")

    def unrecognized(self, extra: list[str]) -> None:
        """Refuse arguments this command does not take, suggesting the closest of its own flags."""
        flags = sorted({o for a in self._actions for o in a.option_strings if o.startswith("--")})
        hints = {}
        for word in extra:
            if word.startswith("--"):
                close = _closest(word.split("=", 1)[0], flags)
                if close:
                    hints[word.split("=", 1)[0]] = close
        hint = f"; did you mean {next(iter(hints.values()))}?" if len(hints) == 1 else (
            "; did you mean " + ", ".join(f"{close} for {word}" for word, close in hints.items()) + "?" if hints
            else "")
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _closest(word: str, allowed: list[str]) -> str | None:
    """The allowed word a misspelt or shortened ``word`` most likely meant (a sole completion first)."""
    starts = [a for a in allowed if a.startswith(word)]
    if len(starts) == 1:
        return starts[0]
    close = difflib.get_close_matches(word, allowed, n=1, cutoff=0.7)
    return close[0] if close else None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fibattn", description="Depth-staggered Fibonacci sparse attention.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", help="print the fibattn and torch versions and exit",
                        version=f"fibattn {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _parser=p)
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
    setup_streams()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        check_text(argv)                   # before parsing: argparse's own messages would show the bytes badly
    except UsageError as exc:
        command = argv[0] if argv and argv[0] in COMMANDS else None
        print(f"fibattn{' ' + command if command else ''}: error: {exc}", file=sys.stderr)
        return 2
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:                          # named by the command's own parser, with its closest flag
            getattr(args, "_parser", parser).unrecognized(extra)
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


def _prog(args) -> str:
    """The command as typed (``fibattn bench train``), for its error lines."""
    parser = getattr(args, "_parser", None)
    return parser.prog if parser is not None else f"fibattn {args.command}"


def _run(args, held: _HeldLog | None) -> int:
    try:
        return int(args._module.run(args) or 0)
    except BrokenPipeError:                # stdout closed early (``fibattn config | head``): not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print("fibattn: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:               # bad input (a UsageError, never a plain ValueError), the file system's
        told = error_line(exc, _setting_of(args, exc) if isinstance(exc, OSError) else None)   # refusal, OOM
        if told is not None:
            if held is not None and not out_of_memory(exc):
                held.let_go(keep=False)   # the error line alone
            print(f"{_prog(args)}: error: {told[1]}", file=sys.stderr)
            return told[0]
        if held is not None:
            held.let_go()                 # what was logged before the traceback, in order
        traceback.print_exc()
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"{_prog(args)}: internal error (a bug in fibattn, not your input; please report it): "
              f"{type(exc).__name__} at {where.filename}:{where.lineno}", file=sys.stderr)
        return 1
