"""Argument checks, decided once: each raises a :class:`UsageError` naming the argument, the value and
what is allowed."""
from __future__ import annotations

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
    """A finite number ``> 0``."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a positive number, got {value!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{name} must be a finite number > 0, got {value}")
    return value


def parse_int_list(text, name: str, minimum: int = 1, error=UsageError, empty: bool = False) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]`` (``""`` -> ``[]`` where ``empty``); anything else raises
    ``error`` naming ``name``."""
    msg = f"{name} must be a comma-separated list of integers >= {minimum}, got {text!r}"
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise error(msg) from None
    if (not values and not empty) or any(v < minimum for v in values):
        raise error(msg)
    return values


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
