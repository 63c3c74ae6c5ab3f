"""Attention assembled from three band primitives (see ``torch_backend`` for their maths).

A *kernel set* is any object with ``scores``, ``wsum`` and ``wsum_t``; each fast backend
provides one, and this module turns it into the integer op (one autograd Function with
a hand-written backward) and the fractional op (autograd through a small mixing matrix).
A kernel set may also have a fused ``attn_forward`` / ``attn_backward`` over
:class:`Columns` (scores, masked softmax and weighted sum in one pass); both ops then
use it, the fractional one with a hand-written gradient for ``alpha``.
Everything here is O(T·|D|·Dh) work and O(T·|D|) extra memory: nothing is T×T.

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..schedules import InterpolationPlan

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _valid(T: int, first: list[int], device) -> torch.Tensor:
    """``(T, n)`` bool: column ``j`` is usable at position ``i`` when ``i >= first[j]``."""
    return torch.arange(T, device=device)[:, None] >= torch.tensor(first, device=device)[None, :]


def _upcast(*xs):
    return [x.float() if x.dtype in _LOW_PRECISION else x for x in xs]


def _fused(kern) -> bool:
    return hasattr(kern, "attn_forward") and hasattr(kern, "attn_backward")


@dataclass(frozen=True)
class Columns:
    """Columns of a fused kernel, sorted by ``lo``: column ``c`` at row ``i`` reads
    ``wlo[c] * x[i - lo[c]] + whi[c] * x[max(i - lo[c] - 1, 0)]`` (the second tap only when
    ``two[c]``) and is valid when ``i >= lo[c]``. ``b[c]`` is the base value of a rung
    (``frac = alpha * b - lo``) and 0 for an exact column."""

    lo: tuple[int, ...]
    wlo: tuple[float, ...]
    whi: tuple[float, ...]
    two: tuple[bool, ...]
    b: tuple[int, ...]

    def __post_init__(self):
        if any(a > b for a, b in zip(self.lo, self.lo[1:])):
            raise ValueError(f"Columns.lo must be sorted ascending, got {self.lo}")


def integer_columns(dists: list[int]) -> Columns:
    n = len(dists)
    return Columns(tuple(dists), (1.0,) * n, (0.0,) * n, (False,) * n, (0,) * n)


def plan_columns(plan: InterpolationPlan, alpha: float) -> Columns:
    """The window columns, then one two-tap column per used rung (``frac = alpha * b - lo``),
    ordered by ``lo`` (a custom base need not be sorted)."""
    cols = integer_columns(list(plan.window))
    rungs = sorted(plan.rungs)
    fracs = [alpha * b - lo for lo, b in rungs]
    return Columns(cols.lo + tuple(lo for lo, _ in rungs), cols.wlo + tuple(1 - f for f in fracs),
                   cols.whi + tuple(fracs), cols.two + (True,) * len(fracs),
                   cols.b + tuple(b for _, b in rungs))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dists, scale, kern):
        dtype = q.dtype
        q, k, v = _upcast(q, k, v)
        group = q.shape[1] // k.shape[1]
        dists = [d for d in dists if d < q.shape[2]]      # columns never valid at this length
        if _fused(kern):
            cols = integer_columns(dists)
            out, p = kern.attn_forward(q, k, v, cols, scale)
            ctx.save_for_backward(q, k, v, p, out)
            ctx.meta = (cols, scale, kern, group, dtype)
            return out.to(dtype)
        s = kern.scores(q, k, dists, group).mul_(scale)
        s.masked_fill_(~_valid(q.shape[2], dists, q.device), float("-inf"))
        p = torch.softmax(s, dim=-1)
        out = kern.wsum(p, v, dists, group)
        ctx.save_for_backward(q, k, v, p, out)
        ctx.meta = (dists, scale, kern, group, dtype)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p, out = ctx.saved_tensors
        dists, scale, kern, group, dtype = ctx.meta
        (dout,) = _upcast(dout.contiguous())
        if isinstance(dists, Columns):
            dq, dk, dv, _ = kern.attn_backward(q, k, v, out, p, dout, dists, scale)
            return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None
        dp = kern.scores(dout, v, dists, group)
        delta = (dout * out).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = kern.wsum(ds, k, dists, group).mul_(scale)
        dk = kern.wsum_t(ds, q, dists, group).mul_(scale)
        dv = kern.wsum_t(p, dout, dists, group)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


def sparse_attention(q, k, v, dists: list[int], scale: float, kern) -> torch.Tensor:
    return _SparseAttention.apply(q, k, v, dists, scale, kern)


class _Scores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, dists, kern):
        group = q.shape[1] // k.shape[1]
        ctx.save_for_backward(q, k)
        ctx.meta = (dists, kern, group)
        return kern.scores(q, k, dists, group)

    @staticmethod
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        dists, kern, group = ctx.meta
        ds = ds.contiguous()
        dq = kern.wsum(ds, k, dists, group) if ctx.needs_input_grad[0] else None
        dk = kern.wsum_t(ds, q, dists, group) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None


class _WSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, v, dists, kern):
        group = p.shape[1] // v.shape[1]
        ctx.save_for_backward(p, v)
        ctx.meta = (dists, kern, group)
        return kern.wsum(p, v, dists, group)

    @staticmethod
    def backward(ctx, dout):
        p, v = ctx.saved_tensors
        dists, kern, group = ctx.meta
        dout = dout.contiguous()
        dp = kern.scores(dout, v, dists, group) if ctx.needs_input_grad[0] else None
        dv = kern.wsum_t(p, dout, dists, group) if ctx.needs_input_grad[1] else None
        return dp, dv, None, None


def mixing_matrix(plan: InterpolationPlan, alpha: torch.Tensor, dtype, device):
    """``(C, |E|)`` weights turning raw scores at integer distances into column scores.

    Window column ``d`` takes entry ``d``; the rung with target ``t = alpha * b`` takes
    ``1 - frac`` of entry ``lo`` and ``frac`` of entry ``lo + 1``. Differentiable in alpha.
    """
    entries = plan.entries
    where = {e: j for j, e in enumerate(entries)}
    n_win = len(plan.window)
    eye = torch.zeros(n_win, len(entries), dtype=dtype, device=device)
    eye[torch.arange(n_win), torch.tensor([where[d] for d in plan.window])] = 1
    if not plan.rungs:
        return eye, entries
    b = torch.tensor([r[1] for r in plan.rungs], dtype=torch.float64, device=device)
    lo = torch.tensor([r[0] for r in plan.rungs], dtype=torch.float64, device=device)
    frac = (alpha.to(device=device, dtype=torch.float64) * b - lo).to(dtype)
    rows = torch.arange(len(plan.rungs), device=device)
    lo_idx = torch.tensor([where[r[0]] for r in plan.rungs], device=device)
    hi_idx = torch.tensor([where[r[0] + 1] for r in plan.rungs], device=device)
    rung = torch.zeros(len(plan.rungs), len(entries), dtype=dtype, device=device)
    rung = rung.index_put((rows, lo_idx), 1 - frac).index_put((rows, hi_idx), frac)
    return torch.cat([eye, rung], dim=0), entries


class _FusedInterpolated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, plan, scale, kern):
        dtype = q.dtype
        q, k, v = _upcast(q, k, v)
        cols = plan_columns(plan, float(alpha.detach()))
        out, p = kern.attn_forward(q, k, v, cols, scale)
        ctx.save_for_backward(q, k, v, p, out)
        ctx.meta = (cols, scale, kern, dtype, alpha.dtype, alpha.device)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p, out = ctx.saved_tensors
        cols, scale, kern, dtype, a_dtype, a_device = ctx.meta
        (dout,) = _upcast(dout.contiguous())
        need = ctx.needs_input_grad[3]
        dq, dk, dv, dfrac = kern.attn_backward(q, k, v, out, p, dout, cols, scale, need_dfrac=need)
        dalpha = None
        if need:       # frac_c = alpha * b_c - lo_c
            dalpha = (dfrac * torch.tensor(cols.b, dtype=torch.float64)).sum().to(a_dtype).to(a_device)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dalpha, None, None, None


def interpolated_sparse_attention(q, k, v, alpha: torch.Tensor, plan: InterpolationPlan,
                                  scale: float, kern) -> torch.Tensor:
    if _fused(kern):
        return _FusedInterpolated.apply(q, k, v, alpha, plan, scale, kern)
    dtype = q.dtype
    q, k, v = _upcast(q, k, v)
    mix, entries = mixing_matrix(plan, alpha, q.dtype, q.device)
    raw = _Scores.apply(q, k, entries, kern)                     # (B, H, T, |E|)
    s = (raw @ mix.t()) * scale                                  # (B, H, T, C)
    first = list(plan.window) + [lo for lo, _ in plan.rungs]
    s = s.masked_fill(~_valid(q.shape[2], first, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = _WSum.apply(p @ mix, v, entries, kern)
    return out.to(dtype)
