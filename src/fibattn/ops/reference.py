"""The plain reference: the definition of correctness (small T, any device).

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``, ``H % Hkv == 0``.
The integer op builds the dense ``T × T`` mask; the fractional op materialises every
interpolated key and value column (method.md §3) and attends over them.

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


def sparse_attention(q, k, v, distances: list[int], scale: float, off=None) -> torch.Tensor:
    """``off``: the documents' offsets (``documents``), or None for one document per row."""
    B, H, T, Dh = q.shape
    dists = sorted({int(d) for d in distances if d < T})         # d >= T is never valid: no T-sized cost
    out_dtype, work = q.dtype, _compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    group = H // k.shape[1]
    k, v = _expand_heads(k, group), _expand_heads(v, group)
    pos = torch.arange(T, device=q.device)
    rel = pos[:, None] - pos[None, :]
    allowed = torch.zeros(T, dtype=torch.bool, device=q.device)
    if dists:
        allowed[torch.tensor(dists, dtype=torch.long, device=q.device)] = True
    mask = (rel >= 0) & allowed[rel.clamp(min=0)]
    if off is not None:                                  # key j in query i's document: i - j <= off[i]
        mask = mask & (rel <= off[:, None, :, None])
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(out_dtype)


def _rows(x: torch.Tensor, dist: int, off=None) -> torch.Tensor:
    """``x[..., max(i - dist, start), :]`` for every position ``i`` (``start`` its document's first
    row: 0 without documents, ``i - off[i]`` with them)."""
    T = x.shape[-2]
    pos = torch.arange(T, device=x.device)
    if off is None:
        return x.index_select(-2, (pos - min(dist, T)).clamp(min=0))
    idx = pos - torch.minimum(off.long(), torch.tensor(dist, device=x.device))     # (B, T)
    return x.gather(-2, idx[:, None, :, None].expand(x.shape))


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
        keys.append((1 - frac) * _rows(k, lo, off) + frac * _rows(k, lo + 1, off))
        values.append((1 - frac) * _rows(v, lo, off) + frac * _rows(v, lo + 1, off))
        first.append(lo)
    kc = torch.stack(keys, dim=-2)                       # (B, H, T, C, Dh)
    vc = torch.stack(values, dim=-2)
    scores = torch.einsum("bhtd,bhtcd->bhtc", q, kc) * scale
    pos = torch.arange(T, device=q.device) if off is None else off[:, None, :].long()     # position in the document
    valid = pos[..., None] >= torch.tensor(first, dtype=torch.long, device=q.device)
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhtc,bhtcd->bhtd", probs, vc).to(out_dtype)
