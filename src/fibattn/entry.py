"""The edges of every entry point (the ``fibattn`` command line, ``python -m fibattn.interop.lm_eval_adapter``),
decided once: what is refused before a command runs, and which errors become one line instead of a traceback.

Text reaches fibattn as UTF-8: an argument or a ``FIBATTN_*`` variable holding other bytes (Python hands them
over as lone surrogates) is refused up front in one line that shows the bytes, since a prompt, a pattern or a
folder name that cannot be encoded fails later, deep inside (a tokenizer, a plot title, a JSON record).
"""
from __future__ import annotations

import errno
import os
import sys

import torch

from .checks import UsageError, shown, utf8_problem
from .files import os_error_line

ENV_PREFIX = "FIBATTN_"


def check_text(argv, environ=None) -> None:
    """Refuse an argument, or a ``FIBATTN_*`` environment variable, that is not UTF-8 text (one line naming the
    flag or variable and the bytes)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        bad = utf8_problem(str(arg))
        if bad is None:
            continue
        flag, _, value = str(arg).partition("=")
        if str(arg).startswith("--") and value:
            what = f"{shown(flag)} '{shown(value)}'"
        elif i and str(argv[i - 1]).startswith("-") and "=" not in str(argv[i - 1]):
            what = f"{argv[i - 1]} '{shown(arg)}'"
        else:
            what = f"argument '{shown(arg)}'"
        raise UsageError(f"{what} holds bytes that are not UTF-8 ({bad}); fibattn reads its arguments as UTF-8 "
                         f"text: retype the text or rename the file or folder")
    env = os.environ if environ is None else environ
    for name in sorted(k for k in env if k.startswith(ENV_PREFIX)):
        bad = utf8_problem(env[name])
        if bad is not None:
            raise UsageError(f"environment variable {name}='{shown(env[name])}' holds bytes that are not UTF-8 "
                             f"({bad}); set it to UTF-8 text")


def setup_streams() -> None:
    """stdout and stderr never fail on a character they cannot encode: it is written as an escape."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", None) not in ("backslashreplace",):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):      # a closed or exotic stream: leave it as it is
                pass


def out_of_memory(exc: BaseException) -> bool:
    """An allocation the machine refused: Python's, a CUDA device's, or torch's CPU allocator's RuntimeError."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def error_line(exc: BaseException, setting: str | None = None) -> tuple[int, str] | None:
    """``(exit status, one line)`` for an error that is the user's input, a file system's refusal or a resource
    running out; None for a bug (the caller keeps its traceback). ``setting``: the flag an OSError's path is from."""
    if isinstance(exc, UsageError):
        return 2, shown(exc)
    if isinstance(exc, UnicodeError) and "surrogate" in str(exc):     # a name read from the system, not UTF-8
        obj = getattr(exc, "object", "")
        return 2, (f"a name holds bytes that are not UTF-8: '{shown(obj)}'; fibattn writes names as UTF-8 text: "
                   f"rename the file or folder")
    if isinstance(exc, OSError):
        code = 1 if exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT) else 2
        return code, shown(os_error_line(exc, setting))
    if out_of_memory(exc):                 # past the size checks' lower bounds: a resource, not a bug
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        return 1, f"out of memory ({shown(why)}); lower the sizes asked for"
    return None
