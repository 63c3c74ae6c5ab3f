"""What a fused kernel attends to: *columns*, from a distance list or an alpha (method.md §1, §3).

A :class:`ColumnSpec` is the static description an op is called with — integer distances,
or a window, a resolved base and a reach for the fractional op. Its column count is fixed
by the spec alone (never by ``alpha`` or by ``T``), so the op's saved state has a shape
the compiler can know in advance; columns that cannot be used at this ``alpha`` or length
are simply never valid.

Host-side kernel sets (``torch``, ``cpu``) turn a spec into :class:`Columns` here; the
``triton`` backend builds the same columns on the device (``triton_kernels.plan_kernel``),
so reading ``alpha`` never synchronises with the GPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..checks import UsageError
from ..schedules import plan_from_values

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ColumnSpec:
    """Integer distances (``dists``), or, when ``dists`` is None, the fractional op's
    ``window``, resolved ``base`` values and ``reach`` (method.md §3)."""

    dists: tuple[int, ...] | None = None
    window: int = 0
    base: tuple[int, ...] = ()
    reach: int | None = None

    @property
    def interpolated(self) -> bool:
        return self.dists is None

    @property
    def count(self) -> int:
        """Columns of every kernel: one per distance, or ``W + 1`` window columns and one per rung."""
        return len(self.dists) if self.dists is not None else self.window + 1 + len(self.base)

    def cap(self, T: int) -> int:
        return min(T, self.reach) - 1 if self.reach is not None else T - 1


@dataclass(frozen=True)
class Columns:
    """Columns of a host kernel, sorted by ``lo``: column ``c`` at row ``i`` reads
    ``wlo[c] * x[i - lo[c]] + whi[c] * x[max(i - lo[c] - 1, 0)]`` (the second tap only when
    ``two[c]``) and is valid when ``i >= lo[c]`` (never when ``lo[c] >= T``). ``b[c]`` is the
    base value of a rung (``frac = alpha * b - lo``) and 0 for an exact column. ``interpolated``:
    the columns of an interpolated spec (whether or not a rung is usable at this length)."""

    lo: tuple[int, ...]
    wlo: tuple[float, ...]
    whi: tuple[float, ...]
    two: tuple[bool, ...]
    b: tuple[int, ...]
    interpolated: bool = False

    def __post_init__(self):
        if any(a > b for a, b in zip(self.lo, self.lo[1:])):
            raise UsageError(f"Columns.lo must be sorted ascending, got {self.lo}")
        object.__setattr__(self, "_hash", hash((self.lo, self.wlo, self.whi, self.two, self.b, self.interpolated)))

    def __hash__(self) -> int:      # once: every kernel call looks its arguments up by its columns
        return self._hash


def _exact(dists) -> Columns:
    n = len(dists)
    return Columns(tuple(dists), (1.0,) * n, (0.0,) * n, (False,) * n, (0,) * n)


@functools.lru_cache(maxsize=256)     # ~15 µs to build; the same (spec, alpha, T) every step unless alpha is learned
def host_columns(spec: ColumnSpec, alpha: float | None, T: int) -> Columns:
    """The ``spec.count`` columns at length ``T``; unusable ones get ``lo = T`` (never valid)."""
    if not spec.interpolated:
        return _exact(sorted(spec.dists))
    plan = plan_from_values(spec.window, alpha, spec.base, spec.cap(T))
    rungs = sorted(plan.rungs)              # a custom base need not be sorted
    fracs = [alpha * b - lo for lo, b in rungs]
    pad = spec.count - len(plan.window) - len(rungs)
    ex = _exact(list(plan.window))
    return Columns(ex.lo + tuple(lo for lo, _ in rungs) + (T,) * pad,
                   ex.wlo + tuple(1 - f for f in fracs) + (1.0,) * pad,
                   ex.whi + tuple(fracs) + (0.0,) * pad,
                   ex.two + (True,) * len(rungs) + (False,) * pad,
                   ex.b + tuple(b for _, b in rungs) + (0,) * pad, interpolated=True)


def dalpha(dfrac: torch.Tensor, b, alpha: torch.Tensor) -> torch.Tensor:
    """``d loss / d alpha = sum_c dfrac_c * b_c`` (``frac_c = alpha * b_c - lo_c``), as alpha's dtype."""
    if dfrac.device.type == "cpu":      # a few dozen columns: one host sum in column order, not five small torch
        total = sum(x * y for x, y in zip(dfrac.tolist(), b))      # ops (0.98x the op at 4K); inf and nan pass
        return torch.tensor(float(total), dtype=alpha.dtype, device=alpha.device)     # (math.fsum would raise)
    b = torch.as_tensor(b, dtype=torch.float64, device=dfrac.device)
    return (dfrac.to(torch.float64) * b).sum().to(device=alpha.device, dtype=alpha.dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What host kernels compute in: float32 for half types, else the input's own dtype."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def host_plan(spec: ColumnSpec, alpha, T: int) -> Columns:
    """:func:`host_columns` for ``alpha`` a 0-d tensor (read on the host) or None (integer distances)."""
    return host_columns(spec, None if alpha is None else float(alpha.detach()), T)


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)      # skips a no-op .to's dispatch (eager calls are µs-bound)


def docs(off) -> dict:
    return {} if off is None else {"off": off}       # a kernel set is called as before without documents


def host_forward(attn_forward, q, k, v, spec: ColumnSpec, alpha, scale: float, plan: Columns | None = None,
                 off=None, save: bool = True):
    """``(out in q's dtype, P)`` through a host kernel set's ``attn_forward`` over Columns
    (``plan``, or the columns of ``spec`` at ``alpha``); ``off`` the documents' offsets (``documents``);
    ``save`` False: no backward follows, and ``P`` may be None."""
    cd = compute_dtype(q.dtype)
    cols = plan if plan is not None else host_plan(spec, alpha, q.shape[2])
    out, P = attn_forward(_to(q, cd), _to(k, cd), _to(v, cd), cols, scale, save=save, **docs(off))
    return _to(out, q.dtype), P


def host_backward(attn_backward, dout, q, k, v, out, P, spec: ColumnSpec, alpha, scale: float,
                  need_dalpha: bool, plan: Columns | None = None, off=None):
    """``(dq, dk, dv, dalpha or None)`` through a host kernel set's ``attn_backward``; ``plan``
    as in :func:`host_forward` (the eager path hands the forward's columns over)."""
    cd = compute_dtype(q.dtype)
    cols = plan if plan is not None else host_plan(spec, alpha, q.shape[2])
    args = [_to(x, cd) for x in (q, k, v, out, P, dout)]   # the kernel set makes them contiguous (cpu: on huge pages)
    dq, dk, dv, dfrac = attn_backward(*args, cols, scale, need_dfrac=need_dalpha, **docs(off))
    da = dalpha(dfrac, cols.b, alpha) if need_dalpha else None
    return _to(dq, q.dtype), _to(dk, k.dtype), _to(dv, v.dtype), da


def host_interface(attn_forward, attn_backward):
    """``(forward, backward, aux_like, plan)`` of the op interface for a host kernel set's fused
    pair; ``forward`` / ``backward`` take an optional ``off=`` (documents) and ``plan=`` (``plan(spec, alpha, T)``'s
    Columns) so that a caller running both computes the columns once."""
    def forward(q, k, v, spec: ColumnSpec, alpha, scale: float, plan: Columns | None = None, off=None,
                save: bool = True):
        return host_forward(attn_forward, q, k, v, spec, alpha, scale, plan, off, save)

    def backward(dout, q, k, v, out, aux, spec: ColumnSpec, alpha, scale: float, need_dalpha: bool,
                 plan: Columns | None = None, off=None):
        return host_backward(attn_backward, dout, q, k, v, out, aux, spec, alpha, scale, need_dalpha, plan, off)

    def aux_like(q, spec: ColumnSpec):
        """The saved softmax state: ``P`` ``(B, H, T, C)`` in the compute dtype."""
        return q.new_empty(*q.shape[:3], spec.count, dtype=compute_dtype(q.dtype))

    return forward, backward, aux_like, host_plan
