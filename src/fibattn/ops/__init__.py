"""The public sparse attention ops (SPEC §1–3).

Layout, stated once: q ``(B, H, T, Dh)``; k, v ``(B, Hkv, T, Dh)`` with ``H % Hkv == 0``
(grouped-query attention: query head ``h`` reads key/value head ``h // (H // Hkv)``);
the output has q's shape and dtype.

Backends (chosen explicitly; ``auto`` logs its pick once):

- ``reference``: dense mask / explicit columns; small T; the definition of correctness.
- ``torch``: shifted slices in pure PyTorch; any device; O(T·|D|) memory.
- ``cpu``: C kernels (OpenMP) compiled on first use; CPU, the fastest there.
- ``flex``: FlexAttention with a block mask; integer distances only; a comparison point.
"""
from __future__ import annotations

import importlib
import logging
import math
from typing import Sequence

import torch

from ..schedules import BaseLike, interpolation_plan
from . import engine

log = logging.getLogger("fibattn")

BACKENDS = ("reference", "torch", "cpu", "flex")
_MODULES = {"reference": "reference", "torch": "torch_backend", "cpu": "cpu_backend", "flex": "flex_backend"}
_KERNEL_SETS = ("torch", "cpu")
_auto_logged: set = set()


def _module(name: str):
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def backend_available(name: str, device: torch.device) -> str | None:
    """``None`` when backend ``name`` can run on ``device``, else the reason it cannot."""
    if name == "reference":
        return None
    if name == "torch":
        return None
    mod = _module(name)
    return mod.unavailable(device)


def resolve_backend(backend: str, device: torch.device, *, interpolated: bool = False) -> str:
    """Turn ``auto`` into a concrete backend and check an explicit one can run here."""
    if backend not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of auto, {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        why = backend_available("cpu", device) if device.type == "cpu" else "not a CPU tensor"
        chosen = "cpu" if why is None else "torch"
        key = (device.type, chosen)
        if key not in _auto_logged:
            _auto_logged.add(key)
            reason = "" if why is None else f" (cpu backend: {why})"
            log.info("fibattn: backend auto -> %s on %s%s", chosen, device.type, reason)
        return chosen
    if interpolated and backend == "flex":
        raise ValueError("backend 'flex' supports integer distances only; use 'cpu', 'torch' or 'reference' "
                         "for interpolated_sparse_attention")
    why = backend_available(backend, device)
    if why is not None:
        raise RuntimeError(f"backend {backend!r} cannot run on {device}: {why}")
    return backend


def _check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, T, Dh), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, T, Dh = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, T, Dh):
        raise ValueError(f"k/v must be (B={B}, Hkv, T={T}, Dh={Dh}) to match q, got {tuple(k.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"H ({H}) must be divisible by Hkv ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_distances(distances) -> list[int]:
    if isinstance(distances, torch.Tensor):
        distances = distances.tolist()
    out = set()
    for d in distances:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"distances must be integers >= 0, got {d!r}")
        out.add(d)
    if 0 not in out:
        raise ValueError("distances must contain 0 so that every query attends to at least itself")
    return sorted(out)


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    return scale


def _empty_like(q):
    return q.new_zeros(q.shape) + 0 * q.sum()


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, distances: Sequence[int], *,
                     scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention where the query at ``i`` sees keys ``i - d`` for ``d`` in ``distances``.

    ``distances`` must contain 0; distances ``>= T`` are simply never valid, so one set
    built at the longest length serves every shorter sequence without rebuilding.
    """
    _check_qkv(q, k, v)
    dists = _check_distances(distances)
    scale = _scale(scale, q.shape[-1])
    name = resolve_backend(backend, q.device)
    if q.shape[2] == 0:
        return _empty_like(q)
    if name == "reference":
        return _module("reference").sparse_attention(q, k, v, dists, scale)
    if name == "flex":
        return _module("flex").sparse_attention(q, k, v, dists, scale)
    return engine.sparse_attention(q, k, v, dists, scale, _module(name))


def interpolated_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, alpha,
                                  base: BaseLike, window: int, reach: int | None = None,
                                  scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Fractional distances ``alpha * b`` by linear interpolation of keys and values (SPEC §3).

    ``alpha`` is a float or a 0-d tensor; gradients reach it through the interpolation
    weights. Equal to :func:`sparse_attention` when every ``alpha * b`` is an integer.
    """
    _check_qkv(q, k, v)
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.tensor(float(alpha), dtype=torch.float64)
    if alpha.dim() != 0:
        raise ValueError(f"alpha must be a float or a 0-d tensor, got shape {tuple(alpha.shape)}")
    scale = _scale(scale, q.shape[-1])
    name = resolve_backend(backend, q.device, interpolated=True)
    T = q.shape[2]
    if T == 0:
        interpolation_plan(window, float(alpha.detach()), base, 1, reach=reach)    # still validate arguments
        return _empty_like(q) + 0 * alpha.to(q.dtype)
    plan = interpolation_plan(window, float(alpha.detach()), base, T, reach=reach)
    if name == "reference":
        out = _module("reference").interpolated_sparse_attention(q, k, v, alpha, plan, scale)
    else:
        out = engine.interpolated_sparse_attention(q, k, v, alpha, plan, scale, _module(name))
    if not plan.rungs and alpha.requires_grad:      # keep alpha in the graph: its gradient is 0
        out = out + 0 * alpha.to(out.dtype)
    return out
