"""Argument checks, decided once: each raises a :class:`UsageError` naming the argument, the value and
what is allowed."""
from __future__ import annotations

import argparse
import math
import numbers


class UsageError(ValueError):
    """Bad input, or a request this machine cannot serve: the CLI prints the message as one line, exit 2.
    Every fibattn error about the user's input derives from it (a ValueError, as before); fibattn raises no
    plain ValueError (tests/test_reliability_bounds.py scans for one), so one that reaches the CLI is a bug."""


class ConfigError(UsageError):
    """A bad config value or argument; the message names the field and what is allowed."""


class BackendUnavailable(UsageError, RuntimeError):
    """A chosen attention backend cannot run here (a RuntimeError too, as API callers caught before)."""


def check_int(name: str, value, minimum: int) -> int:
    """An integer (Python or NumPy, never a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def parse_int(name: str, value, minimum: int) -> int:
    """Like :func:`check_int`, but also accepts text and whole floats (``"8"``, ``8.0``)."""
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if out < minimum or isinstance(value, bool) or (isinstance(value, float) and value != out):
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return out


def check_positive(name: str, value) -> float:
    """A finite number ``> 0`` (Python or NumPy; never a bool or text, which ``float`` would take)."""
    if isinstance(value, (bool, str, bytes)):
        raise UsageError(f"{name} must be a positive number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{name} must be a finite number > 0, got {_short(value)}") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{name} must be a finite number > 0, got {value}")
    return value


def parse_int_list(text, name: str, minimum: int = 1, error=UsageError, empty: bool = False,
                   maximum: int | None = None) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]`` (``""`` -> ``[]`` where ``empty``); anything else raises
    ``error`` naming ``name``. Values above ``maximum`` (default :data:`FLAG_INT_MAX`) are refused too."""
    maximum = FLAG_INT_MAX if maximum is None else maximum
    msg = f"{name} must be a comma-separated list of integers >= {minimum} and <= {maximum}, got {text!r}"
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise error(msg) from None
    if (not values and not empty) or any(not minimum <= v <= maximum for v in values):
        raise error(msg)
    return values


# Numeric command-line flags, checked where they are parsed (every ``type=int`` / ``type=float`` flag of the
# ``fibattn`` parser goes through these): sizes and counts fit a signed 32-bit index unless a flag declares
# otherwise; a seed takes what torch.manual_seed takes.
FLAG_INT_MAX = 2 ** 31 - 1
SEED_MAX = 2 ** 64 - 1


def _short(text, limit: int = 40) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def int_flag(minimum: int | None = None, maximum: int = FLAG_INT_MAX):
    """An argparse ``type`` for an integer flag from ``minimum`` (None: no floor) to ``maximum``; a bad value is
    refused by the parser with the limits (argparse adds the flag's name)."""
    allowed = f"an integer from {minimum} to {maximum}" if minimum is not None else f"an integer <= {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {_short(text)!r}") from None
        if value > maximum or (minimum is not None and value < minimum):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {_short(text)}")
        return value
    parse.__name__ = "int"
    parse.bounds = (minimum, maximum)
    return parse


def float_flag(minimum: float | None = None, maximum: float | None = None):
    """An argparse ``type`` for a finite number within ``[minimum, maximum]`` (None: that side open)."""
    limits = [f">= {minimum:g}"] if minimum is not None else []
    limits += [f"<= {maximum:g}"] if maximum is not None else []
    allowed = " ".join(["a finite number", " and ".join(limits)]).strip()

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {_short(text)!r}") from None
        if not math.isfinite(value) or (minimum is not None and value < minimum) or \
                (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {_short(text)}")
        return value
    parse.__name__ = "float"
    parse.bounds = (minimum, maximum)
    return parse


def did_you_mean(key, allowed) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``allowed`` to a misspelt ``key``, or ``""``."""
    import difflib
    close = difflib.get_close_matches(str(key), sorted(map(str, allowed)), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_keys(what: str, given, allowed) -> None:
    """Refuse a key of an option bag (``what``: the bag as the user names it) that is not in ``allowed``:
    a misspelt option silently left at its default gives a different result."""
    for key in given:
        if key not in allowed:
            raise ConfigError(f"{what}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})"
                              f"{did_you_mean(key, allowed)}")


# ----------------------------------------------------------------------------- text that is not UTF-8
def utf8_problem(text: str) -> str | None:
    """Where ``text`` stops being UTF-8 (``"\\xff at character 1"``), or None when it encodes."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return f"{shown(exc.object[exc.start:exc.end])} at character {exc.start}"


def shown(text) -> str:
    """``text`` printable anywhere: a byte that was not UTF-8 (a lone surrogate U+DC80..U+DCFF, as Python
    decodes it) written as ``\\xNN``, any other lone surrogate as ``\\uNNNN``."""
    text = str(text)
    if utf8_ok(text):
        return text
    return "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else
                   f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
