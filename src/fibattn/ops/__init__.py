"""The public sparse attention ops (method.md §1–3).

Layout, stated once: q ``(B, H, T, Dh)``; k, v ``(B, Hkv, T, Dh)`` with ``H % Hkv == 0``
(grouped-query attention: query head ``h`` reads key/value head ``h // (H // Hkv)``);
the output has q's shape and dtype.

Packed documents: both ops take ``document_ids`` ``(B, T)`` (one contiguous run of equal values
per document, ``documents``); a query then sees only keys of its own document, exactly as if
each document were run on its own.

Backends (``backends``; chosen explicitly, ``auto`` logs its pick once): ``reference``,
``torch``, ``cpu``, ``triton``, ``flex``. The ``torch``, ``cpu`` and ``triton`` kernel sets
run behind ``torch.library`` custom ops (``custom_ops``), so ``torch.compile`` traces
both ops — a learned alpha included — without graph breaks; a compiled call on CUDA goes
through ``triton_ops`` instead, whose Triton kernels the compiler sees and launches itself;
plain eager calls skip the custom-op dispatch and call the kernel set directly (``eager``),
with the same results.
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable
from typing import Sequence

import numpy as np
import torch

from ..checks import UsageError, check_int, check_positive
from ..schedules import Base, BaseLike, as_base, interpolation_plan
from . import custom_ops, eager
from .backends import BACKENDS, backend_available, compiled_triton, resolve_backend
from .columns import ColumnSpec
from .documents import (check_document_ids, document_ids_from_cu_seqlens, document_ids_from_eos,
                        document_ids_from_position_ids, document_offsets)

__all__ = ["BACKENDS", "backend_available", "resolve_backend", "sparse_attention", "interpolated_sparse_attention",
           "check_document_ids", "document_ids_from_cu_seqlens", "document_ids_from_eos",
           "document_ids_from_position_ids"]


def _check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise UsageError(f"{name} must be a 4-D tensor (B, H, T, Dh), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():
            raise UsageError(f"{name} must be a floating-point tensor, got {x.dtype}")
    (B, H, T, Dh), kshape = q.shape, tuple(k.shape)    # each .shape builds a new torch.Size: read once
    if kshape != tuple(v.shape):                       # (tuples compare in C; a torch.Size in Python)
        raise UsageError(f"k and v must have the same shape, got {tuple(kshape)} and {tuple(v.shape)}")
    Bk, Hkv, Tk, Dk = kshape
    if (Bk, Tk, Dk) != (B, T, Dh):
        raise UsageError(f"k/v must be (B={B}, Hkv, T={T}, Dh={Dh}) to match q, got {tuple(kshape)}")
    if Hkv < 1 or H % Hkv:
        raise UsageError(f"H ({H}) must be divisible by Hkv ({Hkv})")
    if not (q.dtype == k.dtype == v.dtype):
        raise UsageError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise UsageError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_distances(distances, T: int) -> list[int]:
    """The distances as a sorted list without repeats, those ``>= T`` dropped (never valid: whatever their size,
    nothing is allocated for them)."""
    if type(distances) in (list, tuple) and not torch.compiler.is_compiling():   # a model passes one list per
        # layer on every call: checked once (the compiler traces the plain function; it warns about lru_cache)
        key = tuple(distances)
        if all(type(d) is int for d in key):   # (bools and other int-likes take the checks below every time)
            return _checked_distances(key, T)
    return _distance_list(distances, T)


def _distance_list(distances, T: int) -> list[int]:
    if isinstance(distances, (torch.Tensor, np.ndarray)):
        distances = distances.tolist()
    if isinstance(distances, (str, bytes)) or not isinstance(distances, Iterable):
        raise UsageError(f"distances must be a list of integers >= 0 containing 0, got {type(distances).__name__}")
    out = set()
    for d in distances:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, numbers.Integral) or d < 0:
            raise UsageError(f"distances must be integers >= 0, got {d!r}")
        out.add(int(d))
    if 0 not in out:
        raise UsageError("distances must contain 0 so that every query attends to at least itself")
    return sorted(d for d in out if d < max(T, 1))


_checked_distances = functools.lru_cache(maxsize=1024)(_distance_list)     # ~8 µs a call otherwise


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    return check_positive("scale", scale)


def _check_alpha(alpha) -> float:
    if isinstance(alpha, torch.Tensor):
        if not alpha.is_floating_point():
            raise UsageError(f"alpha must be a float or a 0-d floating-point tensor, got a {alpha.dtype} tensor")
        return check_positive("alpha", alpha.detach())
    if isinstance(alpha, np.ndarray) and alpha.ndim == 0:
        alpha = alpha.item()
    return check_positive("alpha", alpha)


def _check_window_reach(window, reach, T: int) -> tuple[int, int | None]:
    """``window`` and ``reach`` as Python ints (NumPy's too), the window capped at ``T - 1``: a wider one
    attends the same columns, and no size may be taken from it (its columns are allocated)."""
    window = min(check_int("window", window, 0), max(T - 1, 0))
    return window, (None if reach is None else check_int("reach", reach, 1))


def _base_values(window, base: BaseLike, T: int, reach) -> tuple[int, ...]:
    """The base resolved at length ``T``, after checking window, base and reach (``interpolation_plan``)."""
    interpolation_plan(window, 1.0, base, max(T, 1), reach=reach)
    return tuple(as_base(base).resolve(max(T, 1), reach))


_cached_base_values = functools.lru_cache(maxsize=256, typed=True)(_base_values)   # ~20 µs a call otherwise


def _empty_like(q, k, v):
    """An output with nothing to attend over, in the graph of every input (their gradients exist: zeros)."""
    return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())


def _reference():
    from . import reference
    return reference


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, distances: Sequence[int], *,
                     scale: float | None = None, backend: str = "auto",
                     document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Attention where the query at ``i`` sees keys ``i - d`` for ``d`` in ``distances``.

    ``distances`` must contain 0; distances ``>= T`` are simply never valid, so one set
    built at the longest length serves every shorter sequence without rebuilding.
    ``document_ids`` ``(B, T)``: packed documents; key ``i - d`` is seen only when it lies in
    query ``i``'s document.
    """
    _check_qkv(q, k, v)
    T = q.shape[2]
    dists = _check_distances(distances, T)
    scale = _scale(scale, q.shape[-1])
    name = resolve_backend(backend, q.device)
    off = None if document_ids is None else document_offsets(document_ids, q.shape[0], T, q.device)
    if q.numel() == 0:           # no rows (B, H or T is 0) or Dh = 0: nothing to attend over
        return _empty_like(q, k, v)
    if name == "reference":
        return _reference().sparse_attention(q, k, v, dists, scale, off)
    if name == "flex":
        from . import flex_backend
        return flex_backend.sparse_attention(q, k, v, dists, scale, document_ids)
    if eager.eligible(q, k, v):
        return eager.attention(name, backend, q, k, v, ColumnSpec(tuple(dists)), None, scale, off)
    if compiled_triton(name, q.device):
        from . import triton_ops            # registered by compiled_triton
        return triton_ops.sparse_attention(q, k, v, dists, scale, off)
    if not custom_ops.needs_state(q, k, v):
        return custom_ops.sparse_forward_op(q, k, v, dists, scale, backend, off)
    return custom_ops.SparseAttention.apply(q, k, v, dists, scale, backend, off)[0]


def interpolated_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, alpha,
                                  base: BaseLike, window: int, reach: int | None = None,
                                  scale: float | None = None, backend: str = "auto",
                                  document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Fractional distances ``alpha * b`` by linear interpolation of keys and values (method.md §3).

    ``alpha`` is a float or a 0-d tensor; gradients reach it through the interpolation
    weights. Equal to :func:`sparse_attention` when every ``alpha * b`` is an integer.
    ``document_ids`` as in :func:`sparse_attention` (a rung's second tap stops at the
    document's first token, as it stops at row 0 without documents).
    """
    _check_qkv(q, k, v)
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.tensor(_check_alpha(alpha), dtype=torch.float64)
    if alpha.dim() != 0:
        raise UsageError(f"alpha must be a float or a 0-d tensor, got shape {tuple(alpha.shape)}")
    if alpha.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_alpha(alpha)        # free on the host; a CUDA alpha is never read back (no sync): checked there
    else:                          # on the device (and by a compiled graph), failing at the next sync
        a = alpha.detach()
        torch._assert_async((a > 0) & a.isfinite(), "alpha must be a finite number > 0")
    scale = _scale(scale, q.shape[-1])
    name = resolve_backend(backend, q.device, interpolated=True)
    T = q.shape[2]
    window, reach = _check_window_reach(window, reach, T)
    off = None if document_ids is None else document_offsets(document_ids, q.shape[0], T, q.device)
    # a name or a Base is hashable and immutable (a list or tensor of values is neither); the
    # compiler traces the plain function (T may be symbolic, and it warns about lru_cache)
    cached = isinstance(base, (str, Base)) and isinstance(window, int) and isinstance(reach, (int, type(None))) \
        and not torch.compiler.is_compiling()
    values = (_cached_base_values if cached else _base_values)(window, base, T, reach)
    if q.numel() == 0:
        return _empty_like(q, k, v) + 0 * alpha.to(q.dtype)
    if name == "reference":
        plan = interpolation_plan(window, float(alpha.detach()), base, T, reach=reach)
        out = _reference().interpolated_sparse_attention(q, k, v, alpha, plan, scale, off)
        return out + 0 * alpha.to(out.dtype) if not plan.rungs else out     # alpha stays in the graph
    if eager.eligible(q, k, v, alpha):
        spec = ColumnSpec(None, window, tuple(values), reach)
        return eager.attention(name, backend, q, k, v, spec, alpha, scale, off)
    if compiled_triton(name, q.device):
        from . import triton_ops
        return triton_ops.interpolated_sparse_attention(q, k, v, alpha, window, list(values), reach, scale, off)
    if not custom_ops.needs_state(q, k, v, alpha):
        return custom_ops.interpolated_forward_op(q, k, v, alpha, window, values, reach, scale, backend, off)
    return custom_ops.InterpolatedSparseAttention.apply(q, k, v, alpha, window, values, reach, scale, backend,
                                                        off)[0]
