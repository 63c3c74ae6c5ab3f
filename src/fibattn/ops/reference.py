"""The plain reference: the definition of correctness (small T, any device).

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``, ``H % Hkv == 0``.
Both ops gather each query's columns — its key and value rows at every distance, the fractional op's
interpolated rows (method.md §3) — and attend over them; a column a query does not have (before its
document's start, or row 0) is removed, its rows zeroed before any product, so a non-finite value a query
does not attend never reaches it, forward or backward.

Precision: every dtype the other backends accept runs here (fp16, bf16, fp32, fp64).
Half-precision inputs (fp16, bf16) are computed in fp32 throughout — scores, softmax,
interpolation weights and the weighted sum — and rounded to the input dtype once, at the
output; fp32 and fp64 inputs are computed in their own dtype. So the reference's own error
is one final rounding, never more than a fast backend that accumulates in fp32. Distances
``>= T`` can never be attended and are dropped before anything is allocated, so a distance
of any size costs nothing.
"""
from __future__ import annotations

import torch

from ..schedules import InterpolationPlan

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types; fp32 / fp64 stay as they are."""
    return torch.float32 if dtype in _HALF else dtype


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _rows(x: torch.Tensor, dist: int, off=None) -> torch.Tensor:
    """``x[..., max(i - dist, start), :]`` for every position ``i`` (``start`` its document's first
    row: 0 without documents, ``i - off[i]`` with them)."""
    T = x.shape[-2]
    pos = torch.arange(T, device=x.device)
    if off is None:
        return x.index_select(-2, (pos - min(dist, T)).clamp(min=0))
    idx = pos - torch.minimum(off.long(), torch.tensor(dist, device=x.device))     # (B, T)
    return x.gather(-2, idx[:, None, :, None].expand(x.shape))


def _valid(first, T: int, off, device) -> torch.Tensor:
    """Where each column exists: ``(T, C)``, or ``(B, 1, T, C)`` with documents."""
    pos = torch.arange(T, device=device) if off is None else off[:, None, :].long()     # position in the document
    return pos[..., None] >= torch.tensor(first, dtype=torch.long, device=device)


def _attend(q, keys, values, first, scale: float, off, out_dtype) -> torch.Tensor:
    """Softmax attention of each position over its columns: column ``c`` holds the rows ``keys[c]`` /
    ``values[c]`` (a list of ``(B, H, T, Dh)``) and exists where the position (in its document) is at least
    ``first[c]``. A column that does not exist is *removed*, not weighted by 0: its rows are set to 0 before any
    product (so a NaN or inf there reaches neither the output nor a gradient), its score to -inf."""
    valid = _valid(first, q.shape[2], off, q.device)[..., None]     # (., T, C, 1)
    kc = torch.where(valid, torch.stack(keys, dim=-2), 0.0)          # (B, H, T, C, Dh)
    vc = torch.where(valid, torch.stack(values, dim=-2), 0.0)
    scores = torch.einsum("bhtd,bhtcd->bhtc", q, kc) * scale
    probs = torch.softmax(scores.masked_fill(~valid[..., 0], float("-inf")), dim=-1)
    return torch.einsum("bhtc,bhtcd->bhtd", probs, vc).to(out_dtype)


def sparse_attention(q, k, v, distances: list[int], scale: float, off=None) -> torch.Tensor:
    """``off``: the documents' offsets (``documents``), or None for one document per row."""
    B, H, T, Dh = q.shape
    dists = sorted({int(d) for d in distances if d < T})         # d >= T is never valid: no T-sized cost
    out_dtype, work = q.dtype, _compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    group = H // k.shape[1]
    k, v = _expand_heads(k, group), _expand_heads(v, group)
    return _attend(q, [_rows(k, d, off) for d in dists], [_rows(v, d, off) for d in dists], dists, scale, off,
                   out_dtype)


def interpolated_sparse_attention(q, k, v, alpha: torch.Tensor, plan: InterpolationPlan,
                                  scale: float, off=None) -> torch.Tensor:
    B, H, T, Dh = q.shape
    out_dtype, work = q.dtype, _compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    group = H // k.shape[1]
    k, v = _expand_heads(k, group), _expand_heads(v, group)
    keys, values, first = [], [], []
    for d in plan.window:
        keys.append(_rows(k, d, off))
        values.append(_rows(v, d, off))
        first.append(d)
    for lo, b in plan.rungs:
        frac = (alpha.double() * b - lo).to(work)       # in float64, as the plan chose lo (method.md §3)
        here = _valid([lo], T, off, q.device)          # (T, 1) or (B, 1, T, 1): both taps exist where the rung does
        for rows, x in ((keys, k), (values, v)):          # taps zeroed before they are mixed (alpha's gradient)
            lo_tap, hi_tap = (torch.where(here, _rows(x, d, off), 0.0) for d in (lo, lo + 1))
            rows.append((1 - frac) * lo_tap + frac * hi_tap)
        first.append(lo)
    return _attend(q, keys, values, first, scale, off, out_dtype)
