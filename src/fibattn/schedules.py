"""Bases, per-layer alpha schedules and attended-distance sets (method.md §1–3).

A layer with window ``W``, scale ``alpha`` and base ``B`` lets the query at position
``i`` attend to keys ``i - d`` for ``d`` in::

    D(alpha) = {0..W} ∪ {round(alpha * b) : b in B, W < round(alpha * b) <= cap}

``cap`` is ``seq_len - 1``, or ``reach - 1`` when a ``reach`` (the training length) is
given and smaller. ``round`` is Python's round-half-to-even.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch
from torch import nn

from .checks import UsageError, check_int, check_positive, parse_int

SCHEDULES = ("fixed", "linear", "coprime", "learned", "custom")
BASE_KINDS = ("fib", "pow2", "custom", "none")   # none: the window alone (the window-only controls)


# ----------------------------------------------------------------------------- bases
def fib_base(k: int) -> list[int]:
    """The first ``k`` Fibonacci numbers starting 1, 2: ``1, 2, 3, 5, 8, ...``."""
    check_int("k", k, 1)
    out = [1, 2]
    while len(out) < k:
        out.append(out[-1] + out[-2])
    return out[:k]


def pow2_base(limit: int) -> list[int]:
    """Powers of two ``1, 2, 4, ...`` not above ``limit`` (empty when ``limit < 1``)."""
    check_int("limit", limit, 0)
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


BASE_MAX = 2 ** 63 - 1      # alpha * b is taken in float64, as Python does; a value past this is nothing it can hold
FIB_K_MAX = 91              # fib_base(91)[-1] <= BASE_MAX < fib_base(92)[-1]


def check_custom_base(values: Sequence[int]) -> list[int]:
    vals = list(values)
    if not vals:
        raise UsageError("base must hold at least one positive integer, got an empty list")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= BASE_MAX:
            raise UsageError(f"base values must be integers from 1 to 2**63 - 1, got {v!r}")
    return [int(v) for v in vals]


@dataclass(frozen=True)
class Base:
    """A base spec: ``fib`` (first ``k`` numbers), ``pow2`` (up to the cap), ``custom`` or ``none`` (no rungs)."""

    kind: str = "fib"
    k: int = 15
    values: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.kind not in BASE_KINDS:
            raise UsageError(f"base kind must be one of {BASE_KINDS}, got {self.kind!r}")
        if self.kind == "fib":
            if check_int("base k", self.k, 1) > FIB_K_MAX:
                raise UsageError(f"base k must be at most {FIB_K_MAX} (Fibonacci number {FIB_K_MAX + 1} is past "
                                 f"2**63 - 1), got {self.k}")
        if self.kind == "custom":
            object.__setattr__(self, "values", tuple(check_custom_base(self.values)))

    def resolve(self, seq_len: int, reach: int | None = None) -> list[int]:
        """The base values for sequences of ``seq_len`` (pow2 depends on the cap)."""
        if self.kind == "fib":
            return fib_base(self.k)
        if self.kind == "pow2":
            return pow2_base(distance_cap(seq_len, reach))
        if self.kind == "none":
            return []
        return list(self.values)


BaseLike = Union[Base, str, Sequence[int]]


def as_base(base: BaseLike) -> Base:
    """Accept a :class:`Base`, a name (``"fib"``, ``"fib:20"``, ``"pow2"``) or a list."""
    if isinstance(base, Base):
        return base
    if isinstance(base, str):
        kind, _, arg = base.partition(":")
        if kind == "fib":
            return Base("fib", k=parse_int("base k (in 'fib:K')", arg, 1) if arg else 15)
        if kind in ("pow2", "none") and not arg:
            return Base(kind)
        raise UsageError(f"base must be 'fib', 'fib:K', 'pow2', 'none' or a list of positive integers, got {base!r}")
    if isinstance(base, torch.Tensor) or type(base).__module__ == "numpy":      # a tensor or an array of values
        base = base.tolist()
    return Base("custom", values=tuple(check_custom_base(base)))


def distance_cap(seq_len: int, reach: int | None = None) -> int:
    """The largest attended distance: ``seq_len - 1``, or ``reach - 1`` if smaller."""
    check_int("seq_len", seq_len, 1)
    cap = seq_len - 1
    if reach is not None:
        cap = min(cap, check_int("reach", reach, 1) - 1)
    return cap


# ----------------------------------------------------------------------- distance sets
def attended_distances(window: int, alpha: float, base: BaseLike, seq_len: int, *,
                       reach: int | None = None) -> list[int]:
    """Sorted, unique distances a query attends to (method.md §1); always holds 0..min(W, T-1)."""
    check_int("window", window, 0)
    alpha = check_positive("alpha", alpha)
    cap = distance_cap(seq_len, reach)
    dists = set(range(min(window, cap) + 1))
    for b in as_base(base).resolve(seq_len, reach):
        d = round(alpha * b)
        if window < d <= cap:
            dists.add(d)
    return sorted(dists)


def matched_window(window: int, alphas: Sequence[float], base: BaseLike, seq_len: int, *,
                   reach: int | None = None) -> int:
    """The window ``W'`` of a rung-free model that attends as many columns per query as this one.

    The sparse model's columns at the training length (cap ``seq_len - 1``) are averaged over its
    layers (``alphas``: one per layer, a learned schedule's start values); ``W' + 1`` is that mean,
    rounded: the same cost per query, spent on a contiguous window (the ``window_matched`` control).
    """
    if not alphas:
        raise UsageError("alphas must hold one alpha per layer, got an empty list")
    counts = [len(attended_distances(window, a, base, seq_len, reach=reach)) for a in alphas]
    return max(0, round(sum(counts) / len(counts)) - 1)


@dataclass(frozen=True)
class InterpolationPlan:
    """Columns of the fractional-distance op (method.md §3).

    ``window``: the exact columns ``0..W`` (clipped to the cap).
    ``rungs``: the used base rungs as ``(lo, b)``: target ``t = alpha * b``, ``lo = floor(t)``,
    ``frac = t - lo``; the column mixes rows ``i - lo`` and ``i - lo - 1`` (clamped at 0).
    """

    window: tuple[int, ...]
    rungs: tuple[tuple[int, int], ...]

    @property
    def entries(self) -> list[int]:
        """Every integer distance whose raw score the op needs, sorted and unique."""
        e = set(self.window)
        for lo, _ in self.rungs:
            e.update((lo, lo + 1))
        return sorted(e)

    @property
    def span(self) -> int:
        """The furthest row any column reads, plus one (a KV cache needs this many rows)."""
        return max(self.entries) + 1


def interpolation_plan(window: int, alpha: float, base: BaseLike, seq_len: int, *,
                       reach: int | None = None) -> InterpolationPlan:
    """Which columns the fractional-distance op uses for this ``alpha`` (method.md §3)."""
    check_int("window", window, 0)
    alpha = check_positive("alpha", alpha)
    cap = distance_cap(seq_len, reach)
    return plan_from_values(window, alpha, as_base(base).resolve(seq_len, reach), cap)


def plan_from_values(window: int, alpha: float, values: Sequence[int], cap: int) -> InterpolationPlan:
    """:func:`interpolation_plan` for already resolved base ``values`` and a ``cap``."""
    win = tuple(range(min(window, cap) + 1))
    used: list[tuple[int, int]] = []
    seen: set[int] = set()
    for b in values:
        t = alpha * b
        lo = math.floor(t)
        if round(t) <= window or lo > cap or lo <= window or lo in seen:
            continue
        seen.add(lo)
        used.append((lo, b))
    return InterpolationPlan(win, tuple(used))


# ----------------------------------------------------------------------- alpha schedules
def _check_bounds(a_min: float, a_max: float) -> tuple[float, float]:
    a_min = check_positive("a_min", a_min)
    a_max = check_positive("a_max", a_max)
    if a_min > a_max:
        raise UsageError(f"a_min must be <= a_max, got a_min={a_min} > a_max={a_max}")
    return a_min, a_max


def coprime_stride(n_layers: int) -> int:
    """The largest ``s <= L/2`` with ``gcd(s, L) = 1`` (1 when ``L < 2``)."""
    check_int("n_layers", n_layers, 1)
    for s in range(n_layers // 2, 0, -1):
        if math.gcd(s, n_layers) == 1:
            return s
    return 1


def coprime_slots(n_layers: int) -> list[int]:
    s = coprime_stride(n_layers)
    return [(s * layer) % n_layers for layer in range(n_layers)]


def layer_alphas(schedule: str, n_layers: int, *, a_min: float = 0.5, a_max: float = 1.5,
                 value: float = 1.0, values: Sequence[float] | None = None) -> list[float]:
    """Per-layer alpha for ``fixed | linear | coprime | custom`` (and ``learned``'s start).

    ``learned`` returns its start values: ``value`` everywhere unless ``values`` is given.
    With one layer ``linear`` gives ``a_min``.
    """
    check_int("n_layers", n_layers, 1)
    a_min, a_max = _check_bounds(a_min, a_max)
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule in ("fixed", "learned") and values is None:
        out = [check_positive("value", value)] * n_layers
    elif schedule in ("custom", "learned"):
        if values is None:
            raise UsageError("schedule 'custom' needs values: a list of one alpha per layer")
        out = [check_positive("values[i]", v) for v in values]
        if len(out) != n_layers:
            raise UsageError(f"values must have n_layers={n_layers} entries, got {len(out)}")
    else:
        span = n_layers - 1
        lin = [a_min + (a_max - a_min) * (layer / span if span else 0.0) for layer in range(n_layers)]
        out = lin if schedule == "linear" else [lin[s] for s in coprime_slots(n_layers)]
    for i, a in enumerate(out):
        if not a_min - 1e-12 <= a <= a_max + 1e-12:
            raise UsageError(f"alpha of layer {i} must lie in [a_min, a_max] = [{a_min}, {a_max}], got {a}")
    return out


class LearnedAlphas(nn.Module):
    """One free ``theta`` per layer; ``alpha = a_min + (a_max - a_min) * sigmoid(theta)``.

    ``theta = 0`` gives the midpoint (1.0 with the defaults). ``init`` starts from any
    schedule's values; values on a bound are nudged inside by ``1e-6`` of the range.
    """

    def __init__(self, n_layers: int, *, a_min: float = 0.5, a_max: float = 1.5,
                 init: Sequence[float] | None = None):
        super().__init__()
        check_int("n_layers", n_layers, 1)
        self.a_min, self.a_max = _check_bounds(a_min, a_max)
        if self.a_max == self.a_min:
            raise UsageError(f"a learned alpha needs a_min < a_max, got both {a_min}")
        theta = torch.zeros(n_layers, dtype=torch.float32)
        if init is not None:
            start = layer_alphas("custom", n_layers, a_min=a_min, a_max=a_max, values=init)
            frac = torch.tensor(start, dtype=torch.float64).sub(a_min).div(a_max - a_min)
            theta = torch.logit(frac.clamp(1e-6, 1 - 1e-6)).float()
        self.theta = nn.Parameter(theta)

    def forward(self) -> torch.Tensor:
        return self.a_min + (self.a_max - self.a_min) * torch.sigmoid(self.theta)

    def alpha(self, layer: int) -> torch.Tensor:
        return self.a_min + (self.a_max - self.a_min) * torch.sigmoid(self.theta[layer])
