"""Pure-PyTorch band primitives: one shifted slice per distance, any device, no T×T.

Layout: q / x ``(B, H, T, Dh)``, k / v ``(B, Hkv, T, Dh)``, weights ``p`` ``(B, H, T, n)``
for ``n`` distances ``d_j``; ``group = H // Hkv``. Rows below 0 are clamped to row 0.

- ``scores(q, k, d)[b,h,i,j] = q[b,h,i] · k[b,h//g,max(i-d_j,0)]``
- ``wsum(p, v, d)[b,h,i] = Σ_j p[b,h,i,j] v[b,h//g,max(i-d_j,0)]``
- ``wsum_t(p, x, d)`` is the adjoint of ``wsum`` in ``v``:
  ``y[b,hk,m] = Σ_{h in group hk} Σ_j Σ_{i: max(i-d_j,0)=m} p[b,h,i,j] x[b,h,i]``
"""
from __future__ import annotations

import torch

name = "torch"


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    B, H, T, D = x.shape
    return x.reshape(B, H // group, group, T, D)


def scores(q: torch.Tensor, k: torch.Tensor, dists: list[int], group: int) -> torch.Tensor:
    B, H, T, Dh = q.shape
    out = q.new_empty(B, H, T, len(dists))
    og, qg, kg = _grouped(out, group), _grouped(q, group), k.unsqueeze(2)
    for j, d in enumerate(dists):
        c = min(d, T)
        if c < T:
            og[..., c:, j] = (qg[..., c:, :] * kg[..., : T - c, :]).sum(-1)
        if c:
            og[..., :c, j] = (qg[..., :c, :] * kg[..., :1, :]).sum(-1)
    return out


def wsum(p: torch.Tensor, v: torch.Tensor, dists: list[int], group: int) -> torch.Tensor:
    B, H, T, _ = p.shape
    out = v.new_zeros(B, v.shape[1], group, T, v.shape[-1])
    pg, vg = _grouped(p, group), v.unsqueeze(2)
    for j, d in enumerate(dists):
        c = min(d, T)
        if c < T:
            out[..., c:, :].addcmul_(pg[..., c:, j, None], vg[..., : T - c, :])
        if c:
            out[..., :c, :].addcmul_(pg[..., :c, j, None], vg[..., :1, :])
    return out.reshape(B, H, T, -1)


def wsum_t(p: torch.Tensor, x: torch.Tensor, dists: list[int], group: int) -> torch.Tensor:
    B, H, T, D = x.shape
    out = x.new_zeros(B, H // group, T, D)
    pg, xg = _grouped(p, group), _grouped(x, group)
    for j, d in enumerate(dists):
        c = min(d, T)
        if c < T:
            out[..., : T - c, :] += (pg[..., c:, j, None] * xg[..., c:, :]).sum(2)
        if c:
            out[..., 0, :] += (pg[..., :c, j, None] * xg[..., :c, :]).sum((2, 3))
    return out
