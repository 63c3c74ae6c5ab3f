"""Pure-PyTorch band primitives: one shifted slice per distance, any device, no T×T.

Layout: q / x ``(B, H, T, Dh)``, k / v ``(B, Hkv, T, Dh)``, weights ``p`` ``(B, H, T, n)``
for ``n`` distances ``d_j``; ``group = H // Hkv``. Rows below 0 are clamped to row 0.

- ``scores(q, k, d)[b,h,i,j] = q[b,h,i] · k[b,h//g,max(i-d_j,0)]``
- ``wsum(p, v, d)[b,h,i] = Σ_j p[b,h,i,j] v[b,h//g,max(i-d_j,0)]``
- ``wsum_t(p, x, d)`` is the adjoint of ``wsum`` in ``v``:
  ``y[b,hk,m] = Σ_{h in group hk} Σ_j Σ_{i: max(i-d_j,0)=m} p[b,h,i,j] x[b,h,i]``

The fused interface of a kernel set (``attn_forward`` / ``attn_backward`` over columns) is
built here from these primitives — driven by this module's or by another set's
(``prims=``) — with a two-tap column's raw scores mixed by a small ``(C, E)`` matrix.
"""
from __future__ import annotations

import sys

import torch

from .columns import host_interface

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


# ------------------------------------------------------------------------- columns
def _mixing(cols, T: int, dtype, device):
    """Integer distances whose raw scores the columns need, and the ``(C, E)`` weights
    (``wlo`` on ``lo``, ``whi`` on ``lo + 1``) turning raw scores into column scores; plus the
    ``(C, E)`` matrix of ``x[lo + 1] - x[lo]`` for the gradient of ``frac``, and which entries each column
    reads (``(C, E)`` bool, whatever the weights: a tap of weight 0 is still read)."""
    live = [c for c, lo in enumerate(cols.lo) if lo < T]
    entries = sorted({cols.lo[c] for c in live} | {cols.lo[c] + 1 for c in live if cols.two[c]})
    where = {e: j for j, e in enumerate(entries)}
    mix = torch.zeros(len(cols.lo), len(entries), dtype=torch.float64)
    diff = torch.zeros_like(mix)
    reads = torch.zeros(mix.shape, dtype=torch.bool)
    for c in live:
        lo = cols.lo[c]
        reads[c, where[lo]] = True
        if cols.two[c]:
            mix[c, where[lo]] += cols.wlo[c]
            mix[c, where[lo + 1]] += cols.whi[c]
            diff[c, where[lo]] -= 1
            diff[c, where[lo + 1]] += 1
            reads[c, where[lo + 1]] = True
        else:
            mix[c, where[lo]] += 1
    return entries, mix.to(device=device, dtype=dtype), diff.to(device=device, dtype=dtype), reads.to(device)


class _Documents:
    """The band primitives of ``prims`` with every row clamped at its document's start instead of
    row 0 (``documents``): an entry ``d`` reads row ``i - min(d, off[i])``, so where ``off[i] < d`` it
    reads the start row — one extra row per position, gathered once."""

    def __init__(self, prims, off: torch.Tensor, entries, group: int):
        T = off.shape[1]
        self.prims, self.group = prims, group
        self.start = torch.arange(T, device=off.device) - off.long()                    # (B, T)
        self.early = off[:, None, :, None] < torch.tensor(entries, device=off.device)   # (B, 1, T, E)

    def _at_start(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv[b, h // group, start[b, i]]``: ``(B, H, T, D)`` from a key/value head tensor."""
        idx = self.start[:, None, :, None].expand(kv.shape[0], kv.shape[1], -1, kv.shape[3])
        rows = kv.gather(2, idx)
        return rows.repeat_interleave(self.group, dim=1) if self.group > 1 else rows

    def scores(self, q, k, entries, group):
        s = self.prims.scores(q, k, entries, group)
        return torch.where(self.early, (q * self._at_start(k)).sum(-1, keepdim=True), s)

    def wsum(self, p, v, entries, group):
        out = self.prims.wsum(p.masked_fill(self.early, 0), v, entries, group)
        return out + (p * self.early).sum(-1, keepdim=True) * self._at_start(v)

    def wsum_t(self, p, x, entries, group):
        out = self.prims.wsum_t(p.masked_fill(self.early, 0), x, entries, group)
        B, H, T, D = x.shape
        y = _grouped((p * self.early).sum(-1, keepdim=True) * x, group).sum(2)          # (B, Hkv, T, D)
        idx = self.start[:, None, :, None].expand(B, H // group, T, D)
        return out.scatter_add(2, idx, y)


def _setup(q, k, cols, prims, off):
    group, T = q.shape[1] // k.shape[1], q.shape[2]
    entries, mix, diff, reads = _mixing(cols, T, q.dtype, q.device)
    prims = prims or _SELF
    if off is not None:
        prims = _Documents(prims, off, entries, group)
    lo = torch.tensor(cols.lo, device=q.device)[None, :]
    rows = torch.arange(T, device=q.device)[:, None] if off is None else off[:, None, :, None].long()
    valid = rows >= lo
    return prims, group, entries, mix, diff, valid, (valid.to(q.dtype) @ reads.to(q.dtype)) > 0


# Non-finite values. The primitives read every entry at every position (clamped rows where a column does not
# exist) and mix them by matrix products, so a NaN anywhere would reach rows that never attend it (0 * NaN).
# The maths runs on cleaned copies (non-finite entries zeroed) and the rows that do read a bad value are
# poisoned afterwards: the output and dq of a query that reads one, dk / dv of a row such a query reads.
def clean_rows(x):
    """``x`` with its non-finite entries zeroed, and per row (last dimension) whether it held any."""
    fin = torch.isfinite(x)
    return torch.where(fin, x, 0), ~fin.all(-1)


def _read_bad(prims, bad_kv, read, entries, group, like):
    """``(B, H, T)``: the queries that read (``read``: ``(., T, E)``) a key/value row marked in ``bad_kv``."""
    B, H, T, _ = like.shape
    ones = like.new_ones(B, H, T, 1)
    flags = prims.scores(ones, bad_kv[..., None].to(like.dtype), entries, group)        # (B, H, T, E)
    return ((flags > 0) & read).any(-1)


def _rows_read_by(prims, bad_q, read, entries, group, like):
    """``(B, Hkv, T)``: the key/value rows read by a query marked in ``bad_q``."""
    w = (bad_q[..., None] & read).to(like.dtype)
    return prims.wsum_t(w, like.new_ones(*like.shape[:3], 1), entries, group)[..., 0] > 0


def attn_forward(q, k, v, cols, scale: float, prims=None, off=None, save: bool = True):
    """``(out, P)``: softmax attention over ``cols`` (``columns.Columns``) from the band
    primitives of ``prims`` (default: this module's); ``P`` is ``(B, H, T, C)`` (None unless
    ``save``); ``off`` the documents' offsets (``documents``) or None."""
    prims, group, entries, mix, _, valid, read = _setup(q, k, cols, prims, off)
    (k, kbad), (v, vbad) = clean_rows(k), clean_rows(v)
    s = (prims.scores(q, k, entries, group) @ mix.t()) * scale
    s = s.masked_fill(~valid, float("-inf"))
    P = torch.softmax(s, dim=-1)
    out = prims.wsum(P @ mix, v, entries, group)
    out = out.masked_fill(_read_bad(prims, kbad | vbad, read, entries, group, q)[..., None], float("nan"))
    return out, P if save else None


def attn_backward(q, k, v, out, P, dout, cols, scale: float, need_dfrac: bool = False, prims=None, off=None):
    """``(dq, dk, dv, dfrac)``; ``dfrac[c]`` (float64, or None) is d loss / d frac of column ``c``."""
    prims, group, entries, mix, diff, valid, read = _setup(q, k, cols, prims, off)
    (q, qbad), (k, kbad), (v, vbad), (dout, dbad) = clean_rows(q), clean_rows(k), clean_rows(v), clean_rows(dout)
    out, P = clean_rows(out)[0], torch.nan_to_num(P, nan=0.0)
    dp_raw = prims.scores(dout, v, entries, group)
    delta = (dout * out).sum(-1, keepdim=True)
    dS = P * (dp_raw @ mix.t() - delta)
    dS_e = dS @ mix
    dq = prims.wsum(dS_e, k, entries, group).mul_(scale)
    dk = prims.wsum_t(dS_e, q, entries, group).mul_(scale)
    dv = prims.wsum_t(P @ mix, dout, entries, group)
    bad = _read_bad(prims, kbad | vbad, read, entries, group, q) | qbad | dbad       # queries whose gradients are NaN
    dq = dq.masked_fill(bad[..., None], float("nan"))
    hit = _rows_read_by(prims, bad, read, entries, group, q)[..., None]
    dk, dv = dk.masked_fill(hit, float("nan")), dv.masked_fill(hit, float("nan"))
    dfrac = None
    if need_dfrac:      # d s_c / d frac = scale q.(k[lo+1] - k[lo]); d out / d frac = P_c (v[lo+1] - v[lo])
        s_diff = prims.scores(q, k, entries, group) @ diff.t()
        dfrac = ((dS * s_diff).sum((0, 1, 2)) * scale + (P * (dp_raw @ diff.t())).sum((0, 1, 2))).double()
        rung = torch.tensor(cols.two, device=q.device)          # alpha reaches the rungs alone
        dfrac = dfrac.masked_fill((bad[..., None] & valid & rung).flatten(0, -2).any(0), float("nan"))
    return dq, dk, dv, dfrac


forward, backward, aux_like, plan = host_interface(attn_forward, attn_backward)      # the op interface
_SELF = sys.modules[__name__]
