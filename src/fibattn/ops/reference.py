"""The plain reference: the definition of correctness (small T, any device).

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``, ``H % Hkv == 0``.
The integer op builds the dense ``T × T`` mask; the fractional op materialises every
interpolated key and value column (method.md §3) and attends over them.
"""
from __future__ import annotations

import torch

from ..schedules import InterpolationPlan


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in fp32 for half types and in the input dtype otherwise."""
    low = scores.dtype in (torch.float16, torch.bfloat16)
    return torch.softmax(scores.float() if low else scores, dim=-1)


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def sparse_attention(q, k, v, distances: list[int], scale: float) -> torch.Tensor:
    B, H, T, Dh = q.shape
    group = H // k.shape[1]
    k, v = _expand_heads(k, group), _expand_heads(v, group)
    pos = torch.arange(T, device=q.device)
    rel = pos[:, None] - pos[None, :]
    allowed = torch.zeros(max(T, max(distances) + 1), dtype=torch.bool, device=q.device)
    allowed[torch.tensor(distances, device=q.device)] = True
    mask = (rel >= 0) & allowed[rel.clamp(min=0)]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return _softmax(scores).to(q.dtype) @ v


def _rows(x: torch.Tensor, dist: int) -> torch.Tensor:
    """``x[..., max(i - dist, 0), :]`` for every position ``i``."""
    T = x.shape[-2]
    idx = (torch.arange(T, device=x.device) - dist).clamp(min=0)
    return x.index_select(-2, idx)


def interpolated_sparse_attention(q, k, v, alpha: torch.Tensor, plan: InterpolationPlan,
                                  scale: float) -> torch.Tensor:
    B, H, T, Dh = q.shape
    group = H // k.shape[1]
    k, v = _expand_heads(k, group), _expand_heads(v, group)
    keys, values, first = [], [], []
    for d in plan.window:
        keys.append(_rows(k, d))
        values.append(_rows(v, d))
        first.append(d)
    for lo, b in plan.rungs:
        frac = (alpha.double() * b - lo).to(q.dtype)      # in float64, as the plan chose lo (method.md §3)
        keys.append((1 - frac) * _rows(k, lo) + frac * _rows(k, lo + 1))
        values.append((1 - frac) * _rows(v, lo) + frac * _rows(v, lo + 1))
        first.append(lo)
    kc = torch.stack(keys, dim=-2)                       # (B, H, T, C, Dh)
    vc = torch.stack(values, dim=-2)
    scores = torch.einsum("bhtd,bhtcd->bhtc", q, kc) * scale
    pos = torch.arange(T, device=q.device)
    valid = pos[:, None] >= torch.tensor(first, device=q.device)[None, :]
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = _softmax(scores).to(q.dtype)
    return torch.einsum("bhtc,bhtcd->bhtd", probs, vc)
