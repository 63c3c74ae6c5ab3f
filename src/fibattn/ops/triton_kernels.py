"""Triton kernels of the ``triton`` backend: fused sparse attention over *columns*.

Imported only by :mod:`fibattn.ops.triton_backend`, after ``TRITON_INTERPRET`` is settled
(Triton reads it when a kernel is defined).

Layout: q, out, dout ``(B, H, T, Dh)``; k, v ``(B, Hkv, T, Dh)``, unit stride on ``Dh``;
``lse`` and ``delta`` ``(B, H, T)`` in the accumulation dtype (float32; float64 for
float64 inputs). Query head ``h`` reads key/value head
``h // GROUP``. One program owns a tile of ``BLOCK_M`` consecutive rows of one key/value
head and *all* ``GROUP`` query heads that read it, so every key/value tile it loads is
shared by the group.

Columns (arrays ``LO``, ``WLO``, ``WHI`` of length ``C``): column ``c`` of query row ``i``
reads ``WLO[c] * x[i - LO[c]] + WHI[c] * x[max(i - LO[c] - 1, 0)]`` and is valid when
``i >= LO[c]`` (``LO[c] >= T``: never valid). With ``TWO_TAP`` the columns ``c >= NWIN``
are interpolated rungs (method.md §3) whose second tap is always read, so that the gradient of
``frac`` (``WHI``) exists even at ``frac = 0``; without it every column is one exact tap.

The pattern is shift-invariant: for a row tile ``[i0, i0 + M)`` a column reads the
contiguous key rows ``[i0 - lo, i0 - lo + M)``, and in the backward a key tile
``[j0, j0 + M)`` is read by the contiguous query rows ``[j0 + lo, ...)`` — so the key and
value gradients are gathered per key tile, with no atomics, and every result is written
by one program (deterministic). Scores are kept in base 2 (``qk_scale = scale * log2 e``);
``lse`` is in those units. ``T``, ``C`` and ``NWIN`` are runtime values: a new length
(or window) never recompiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

NEVER = 1 << 30       # LO of a column that is never valid (a rung not used at this alpha)
_NEVER = tl.constexpr(NEVER)


@triton.jit(do_not_specialize=["CAP"])
def plan_kernel(ALPHA, BASE, LO, WLO, WHI, K, CAP, W: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """method.md §3 on the device: window columns ``0..W`` (capped), then one column per base rung.

    A rung ``b`` has target ``t = alpha * b`` (float64, as Python computes it), ``lo =
    floor(t)``; it is used when ``W < lo <= CAP`` and no earlier used rung has the same
    ``lo`` (``round(t) > W`` follows from ``lo > W``). Unused rungs get ``LO = NEVER``.
    """
    offs_w = tl.arange(0, BLOCK_W)
    in_w = offs_w <= W
    tl.store(LO + offs_w, tl.where(offs_w <= CAP, offs_w, _NEVER), mask=in_w)
    tl.store(WLO + offs_w, tl.full([BLOCK_W], 1.0, tl.float64), mask=in_w)
    tl.store(WHI + offs_w, tl.zeros([BLOCK_W], tl.float64), mask=in_w)

    alpha = tl.load(ALPHA).to(tl.float64)
    offs_k = tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    b = tl.load(BASE + offs_k, mask=in_k, other=0).to(tl.float64)
    t = alpha * b
    lo = t.to(tl.int64)                      # t >= 0: truncation is floor
    cand = in_k & (lo > W) & (lo <= CAP)
    earlier = (offs_k[:, None] < offs_k[None, :]) & cand[:, None] & (lo[:, None] == lo[None, :])
    dup = tl.sum(earlier.to(tl.int32), axis=0) > 0
    used = cand & (dup == 0)
    frac = t - lo.to(tl.float64)
    tl.store(LO + W + 1 + offs_k, tl.where(used, lo, _NEVER).to(tl.int32), mask=in_k)
    tl.store(WLO + W + 1 + offs_k, 1.0 - frac, mask=in_k)
    tl.store(WHI + W + 1 + offs_k, frac, mask=in_k)


@triton.jit
def _tap_rows(base, rows, stride_t, offs_d, mask):
    """Rows ``rows`` (``(M,)``, already clamped) of one head as an ``(M, D)`` block."""
    return tl.load(base + rows[:, None] * stride_t + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _program(T, HKV, GROUP, DH, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's batch ``b``, key/value head ``hk``, rows ``[r0, r0 + BLOCK_M)``, the query
    heads ``h`` of its group, and the masks of each axis."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)      # int64 offsets: B * H * T * Dh may exceed 2**31
    hk = pid_bh % HKV
    r0 = pid_m * BLOCK_M
    offs_g = tl.arange(0, BLOCK_G)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return b, hk, r0, offs_r, offs_d, hk * GROUP + offs_g, offs_g < GROUP, offs_r < T, offs_d < DH


@triton.jit
def _heads(base, b, h, rows, offs_d, s_b, s_h, s_t, mask):
    """The ``(G, M, D)`` block of query heads ``h`` at ``rows``."""
    return tl.load(base + b * s_b + h[:, None, None] * s_h + rows[None, :, None] * s_t + offs_d[None, None, :],
                   mask=mask, other=0.0)


@triton.jit
def _column(kb, vb, lo, WLO, WHI, c, NWIN, offs_m, in_m, offs_d, in_d, skt, svt,
            TWO_TAP: tl.constexpr, ACC: tl.constexpr):
    """Column ``c`` (at ``lo``) for query rows ``offs_m``: ``valid`` rows, the first tap's keys and values
    ``x[i - lo]``, and (rungs of the two-tap op only) the second tap's ``x[max(i - lo - 1, 0)]``
    with the weights ``wlo``, ``whi``."""
    rows = offs_m - lo
    valid = (rows >= 0) & in_m
    md = valid[:, None] & in_d[None, :]
    key = _tap_rows(kb, rows, skt, offs_d, md).to(ACC)
    val = _tap_rows(vb, rows, svt, offs_d, md).to(ACC)
    if TWO_TAP:
        md2 = md & ((offs_m * 0 + c) >= NWIN)[:, None]     # only rungs read a second tap
        rows2 = tl.maximum(rows - 1, 0)
        key2 = _tap_rows(kb, rows2, skt, offs_d, md2).to(ACC)
        val2 = _tap_rows(vb, rows2, svt, offs_d, md2).to(ACC)
        return valid, key, val, key2, val2, tl.load(WLO + c).to(ACC), tl.load(WHI + c).to(ACC)
    else:
        return valid, key, val, key, val, 1.0, 0.0


@triton.jit(do_not_specialize=["T", "C", "NWIN"])
def fwd_kernel(Q, K, V, O, LSE, LO, WLO, WHI,
               sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
               T, C, NWIN, HKV, H, GROUP, DH, qk_scale,
               TWO_TAP: tl.constexpr, ACC: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    b, hk, i0, offs_m, offs_d, h, in_g, in_m, in_d = _program(T, HKV, GROUP, DH, BLOCK_G, BLOCK_M, BLOCK_D)
    gmd = in_g[:, None, None] & in_m[None, :, None] & in_d[None, None, :]
    q = _heads(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, gmd).to(ACC)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh

    m_i = tl.full([BLOCK_G, BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_G, BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_G, BLOCK_M, BLOCK_D], ACC)
    for c in range(C):
        lo = tl.load(LO + c)
        if lo < i0 + BLOCK_M:                            # some row of this tile may use it
            valid, key, val, key2, val2, wlo, whi = _column(kb, vb, lo, WLO, WHI, c, NWIN, offs_m, in_m, offs_d,
                                                            in_d, skt, svt, TWO_TAP, ACC)
            if TWO_TAP:
                key = wlo * key + whi * key2
                val = wlo * val + whi * val2
            s = tl.sum(q * key[None, :, :], axis=2) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            corr = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use)
            l_i = l_i * corr + p
            acc = acc * corr[:, :, None] + p[:, :, None] * val[None, :, :]
            m_i = m_new
    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_use[:, :, None]
    tl.store(O + b * sob + h[:, None, None] * soh + offs_m[None, :, None] * sot + offs_d[None, None, :],
             out.to(O.dtype.element_ty), mask=gmd)
    lse = (m_i + tl.log2(l_use)).to(LSE.dtype.element_ty)
    tl.store(LSE + (b * H + h[:, None]) * T + offs_m[None, :], lse, mask=in_g[:, None] & in_m[None, :])


@triton.jit(do_not_specialize=["T", "C", "NWIN"])
def bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, EDGE_K, EDGE_V, DFRAC, LO, WLO, WHI,
                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdb, sdh, sdt,
                  sdqb, sdqh, sdqt, T, C, NWIN, HKV, H, GROUP, DH, qk_scale, sm_scale,
                  TWO_TAP: tl.constexpr, NEED_DFRAC: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """By query tile: ``delta = rowsum(dout * out)`` (stored for the key pass), ``dq``, the
    per-program sums of d loss / d frac per column (``DFRAC``), and ``EDGE_*``: the
    contribution of query row ``lo`` whose clamped second tap reads key row 0."""
    b, hk, i0, offs_m, offs_d, h, in_g, in_m, in_d = _program(T, HKV, GROUP, DH, BLOCK_G, BLOCK_M, BLOCK_D)
    gmd = in_g[:, None, None] & in_m[None, :, None] & in_d[None, None, :]
    gm = in_g[:, None] & in_m[None, :]
    q = _heads(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, gmd).to(ACC)
    do = _heads(DO, b, h, offs_m, offs_d, sdb, sdh, sdt, gmd).to(ACC)
    o = _heads(O, b, h, offs_m, offs_d, sob, soh, sot, gmd).to(ACC)
    stat = (b * H + h[:, None]) * T + offs_m[None, :]
    delta = tl.sum(do * o, axis=2)
    tl.store(DELTA + stat, delta.to(DELTA.dtype.element_ty), mask=gm)
    lse = tl.load(LSE + stat, mask=gm, other=0.0).to(ACC)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh

    dq = tl.zeros([BLOCK_G, BLOCK_M, BLOCK_D], ACC)
    for c in range(C):
        lo = tl.load(LO + c)
        if lo < i0 + BLOCK_M:
            valid, key, val, key2, val2, wlo, whi = _column(kb, vb, lo, WLO, WHI, c, NWIN, offs_m, in_m, offs_d,
                                                            in_d, skt, svt, TWO_TAP, ACC)
            if TWO_TAP:
                kmix = wlo * key + whi * key2
                vmix = wlo * val + whi * val2
            else:
                kmix = key
                vmix = val
            s = tl.sum(q * kmix[None, :, :], axis=2) * qk_scale
            p = tl.where(valid[None, :] & in_g[:, None], tl.exp2(s - lse), 0.0)
            dp = tl.sum(do * vmix[None, :, :], axis=2)
            ds = p * (dp - delta)
            dq += ds[:, :, None] * kmix[None, :, :]
            if TWO_TAP:
                if c >= NWIN:
                    if NEED_DFRAC:            # d s / d frac = scale q.(k2 - k), d out / d frac = p (v2 - v)
                        ks = tl.sum(q * (key2 - key)[None, :, :], axis=2)
                        vs = tl.sum(do * (val2 - val)[None, :, :], axis=2)
                        part = tl.sum(tl.sum(ds * ks * sm_scale + p * vs, axis=1), axis=0)
                        slot = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
                        tl.store(DFRAC + slot * C + c, part.to(tl.float64))
                    if lo >= i0:              # row lo is in this tile: its second tap is clamped to row 0
                        at = (offs_m == lo)[None, :, None]
                        ek = tl.sum(tl.sum(tl.where(at, ds[:, :, None] * q, 0.0), axis=1), axis=0) * whi
                        ev = tl.sum(tl.sum(tl.where(at, p[:, :, None] * do, 0.0), axis=1), axis=0) * whi
                        edge = (tl.program_id(1) * C + c) * DH + offs_d
                        tl.store(EDGE_K + edge, ek.to(EDGE_K.dtype.element_ty), mask=in_d)
                        tl.store(EDGE_V + edge, ev.to(EDGE_V.dtype.element_ty), mask=in_d)
    tl.store(DQ + b * sdqb + h[:, None, None] * sdqh + offs_m[None, :, None] * sdqt + offs_d[None, None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=gmd)


@triton.jit
def _key_pass(Q, DO, LSE, DELTA, kmix, vmix, qi, ok, b, h, in_g, offs_d, in_d,
              sqb, sqh, sqt, sdb, sdh, sdt, T, H, qk_scale, ACC: tl.constexpr):
    """For the query rows ``qi`` (``(M,)``, valid where ``ok``) that read a key tile through one
    tap: ``(sum_g ds * q, sum_g p * dout)``, each ``(M, D)``."""
    gmd = in_g[:, None, None] & ok[None, :, None] & in_d[None, None, :]
    q = _heads(Q, b, h, qi, offs_d, sqb, sqh, sqt, gmd).to(ACC)
    do = _heads(DO, b, h, qi, offs_d, sdb, sdh, sdt, gmd).to(ACC)
    gm = in_g[:, None] & ok[None, :]
    stat = (b * H + h[:, None]) * T + qi[None, :]
    lse = tl.load(LSE + stat, mask=gm, other=0.0).to(ACC)
    delta = tl.load(DELTA + stat, mask=gm, other=0.0).to(ACC)
    s = tl.sum(q * kmix[None, :, :], axis=2) * qk_scale
    p = tl.where(gm, tl.exp2(s - lse), 0.0)
    ds = p * (tl.sum(do * vmix[None, :, :], axis=2) - delta)
    return tl.sum(ds[:, :, None] * q, axis=0), tl.sum(p[:, :, None] * do, axis=0)


@triton.jit(do_not_specialize=["T", "C", "NWIN"])
def bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, EDGE_K, EDGE_V, LO, WLO, WHI,
                    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                    T, C, NWIN, HKV, H, GROUP, DH, qk_scale, sm_scale,
                    TWO_TAP: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """By key tile ``[j0, j0 + M)``: a column at ``lo`` is read through its first tap by query
    rows ``j + lo`` (key ``wlo k[j] + whi k[j - 1]``) and through its second by rows
    ``j + lo + 1`` (key ``wlo k[j + 1] + whi k[j]``)."""
    b, hk, j0, offs_j, offs_d, h, in_g, in_j, in_d = _program(T, HKV, GROUP, DH, BLOCK_G, BLOCK_M, BLOCK_D)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh
    jd = in_j[:, None] & in_d[None, :]
    k0 = _tap_rows(kb, offs_j, skt, offs_d, jd).to(ACC)
    v0 = _tap_rows(vb, offs_j, svt, offs_d, jd).to(ACC)
    if TWO_TAP:
        km = _tap_rows(kb, tl.maximum(offs_j - 1, 0), skt, offs_d, jd).to(ACC)
        vm = _tap_rows(vb, tl.maximum(offs_j - 1, 0), svt, offs_d, jd).to(ACC)
        jd1 = (offs_j + 1 < T)[:, None] & in_d[None, :]
        kp = _tap_rows(kb, offs_j + 1, skt, offs_d, jd1).to(ACC)
        vp = _tap_rows(vb, offs_j + 1, svt, offs_d, jd1).to(ACC)

    dk = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for c in range(C):
        lo = tl.load(LO + c)
        if j0 + lo < T:
            qi = offs_j + lo
            if TWO_TAP:
                wlo = tl.load(WLO + c).to(ACC)
                whi = tl.load(WHI + c).to(ACC)
                gk, gv = _key_pass(Q, DO, LSE, DELTA, wlo * k0 + whi * km, wlo * v0 + whi * vm, qi, qi < T,
                                   b, h, in_g, offs_d, in_d, sqb, sqh, sqt, sdb, sdh, sdt, T, H, qk_scale, ACC)
                dk += wlo * gk
                dv += wlo * gv
                if whi != 0.0:
                    if j0 + lo + 1 < T:
                        qi1 = qi + 1
                        gk, gv = _key_pass(Q, DO, LSE, DELTA, wlo * kp + whi * k0, wlo * vp + whi * v0, qi1,
                                           qi1 < T, b, h, in_g, offs_d, in_d, sqb, sqh, sqt, sdb, sdh, sdt, T, H,
                                           qk_scale, ACC)
                        dk += whi * gk
                        dv += whi * gv
            else:
                gk, gv = _key_pass(Q, DO, LSE, DELTA, k0, v0, qi, qi < T, b, h, in_g, offs_d, in_d,
                                   sqb, sqh, sqt, sdb, sdh, sdt, T, H, qk_scale, ACC)
                dk += gk
                dv += gv
    if TWO_TAP:
        if j0 == 0:                                  # second taps clamped to row 0 (see bwd_dq_kernel)
            ek = tl.zeros([BLOCK_D], ACC)
            ev = tl.zeros([BLOCK_D], ACC)
            for c in range(NWIN, C):
                edge = (tl.program_id(1) * C + c) * DH + offs_d
                ek += tl.load(EDGE_K + edge, mask=in_d, other=0.0).to(ACC)
                ev += tl.load(EDGE_V + edge, mask=in_d, other=0.0).to(ACC)
            first = (offs_j == 0)[:, None]
            dk += tl.where(first, ek[None, :], 0.0)
            dv += tl.where(first, ev[None, :], 0.0)
    tl.store(DK + b * sdkb + hk * sdkh + offs_j[:, None] * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=jd)
    tl.store(DV + b * sdvb + hk * sdvh + offs_j[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=jd)
