"""The ``triton`` backend's backward kernels: the query pass (``dq``, ``delta`` and the rungs' stored ``P``, ``dS``)
and the key pass (``dk``, ``dv``). Layout, unit of work and method: :mod:`fibattn.ops.triton_kernels`, which
alone imports this module.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import (
    _NEVER,
    _any,
    _any_flagged,
    _any_unfinished,
    _chunk_rows,
    _chunks,
    _column_offsets,
    _doc_off,
    _dot_t,
    _flagged,
    _head_flags,
    _last,
    _mac,
    _mac_p,
    _mid,
    _per_rung,
    _per_rung_sum,
    _program,
    _rows,
    _rung_keys,
    _scale,
    _stored,
    _tile,
    _unfinished,
)


@triton.jit(do_not_specialize=["T", "R", "WB"])
def bwd_dq_kernel(Q, K, V, OUT, DO, LSE, DELTA, DQ, PR, DSR, DFRAC, FLAGS, RLO, RWLO, RWHI, RN, OFF,
                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdb, sdh, sdt,
                  sdqb, sdqh, sdqt, T, R, WB, HKV, H, GROUP, qk_scale, qk_lo, sm_scale, sm_lo,
                  TWO_TAP: tl.constexpr, NEED_DFRAC: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr,
                  IN: tl.constexpr, DOT: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, RB: tl.constexpr, MC: tl.constexpr, CHECK: tl.constexpr, DH: tl.constexpr,
                  WIDE: tl.constexpr):
    """By query tile: ``delta = rowsum(dout * out)`` (stored for the key pass), ``dq``, the
    rungs' ``P`` and ``dS`` per (row, head, rung), and the per-program sums of d loss / d frac. Launched twice,
    ``CHECK`` as the forward's."""
    C: tl.constexpr = BLOCK_M // MC
    GMC: tl.constexpr = BLOCK_G * MC
    b, hk, i0, m, h, row_ok = _tile(T, HKV, GROUP, BLOCK_G, BLOCK_M, MC, WIDE)
    bhk = b * HKV + hk
    if _any_flagged(FLAGS, bhk, T) != CHECK:          # the other launch's head
        return
    qk_scale, sm_scale = _scale(qk_scale, qk_lo, ACC), _scale(sm_scale, sm_lo, ACC)
    i = i0 + m
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < DH
    q = _rows(Q + b * sqb, h * sqh + i * sqt, offs_d, row_ok, in_d)
    do = _rows(DO + b * sdb, h * sdh + i * sdt, offs_d, row_ok, in_d)
    o = _rows(OUT + b * sob, h * soh + i * sot, offs_d, row_ok, in_d)
    stat = (b * H + h) * T + i
    delta = tl.sum(do.to(ACC) * o.to(ACC), axis=1)
    lse = tl.load(LSE + stat, mask=row_ok, other=0.0).to(ACC)
    # the key pass reads a NaN delta as "this row is unfinished" (a NaN / inf in its q, dout or a row it read), and
    # takes its checked launch for the heads that hold one
    fin = _unfinished(lse, delta)
    tl.store(DELTA + stat, tl.where(fin, float("nan"), delta).to(DELTA.dtype.element_ty), mask=row_ok)
    if _any(fin & row_ok):
        tl.atomic_or(_head_flags(FLAGS, bhk, T) + T + 1, 1)
    q = q.to(IN)
    do = do.to(IN)
    orow = _doc_off(OFF, b, T, i, HAS_DOCS)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh

    dq = tl.zeros([BLOCK_G * BLOCK_M, BLOCK_D], ACC)
    dq = _dq_band(dq, q, do, i, i0, orow, kb, vb, FLAGS, bhk, T, WB, skt, svt, offs_d, in_d, qk_scale, lse, delta,
                  row_ok, HAS_DOCS, IN, DOT, ACC, BLOCK_M, BLOCK_N, CHECK)
    # the rungs, chunk by chunk (the forward's (C, G·MC, ·) blocks)
    q, do, dq, lse, delta, rok, stat = _chunks(q, C, GMC), _chunks(do, C, GMC), _chunks(dq, C, GMC), \
        _chunks(lse, C, GMC), _chunks(delta, C, GMC), _chunks(row_ok, C, GMC), _chunks(stat, C, GMC)
    dq = _dq_rungs(dq, q, do, i0, OFF, b, kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, RN, PR, DSR, DFRAC, T, R, skt, svt,
                   offs_d, in_d, qk_scale, sm_scale, lse, delta, rok, stat, TWO_TAP, NEED_DFRAC, HAS_DOCS, ACC, IN, DOT,
                   RB, MC, C, CHECK)
    h, i, row_ok = _chunk_rows(hk * GROUP, i0, T, GROUP, BLOCK_G, MC, C)
    tl.store(DQ + b * sdqb + _last(h * sdqh + i * sdqt) + offs_d, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=_last(row_ok) & in_d)


@triton.jit
def _dq_band(dq, q, do, i, i0, orow, kb, vb, FLAGS, bhk, T, WB, skt, svt, offs_d, in_d, qk_scale, lse, delta, row_ok,
             HAS_DOCS: tl.constexpr, IN: tl.constexpr, DOT: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, CHECK: tl.constexpr):
    """The query pass over the band: ``dq`` of keys ``[i0 - WB, i0 + M)``. ``CHECK`` as in :func:`_fwd_band`."""
    for n0 in range(i0 - WB, i0 + BLOCK_M, BLOCK_N):
        kr = n0 + tl.arange(0, BLOCK_N)
        kok = (kr >= 0) & (kr < T)
        k = _rows(kb, kr * skt, offs_d, kok & ~_flagged(FLAGS, bhk, T, kr, kok, 1, CHECK), in_d)     # dq = dS . K
        v = _rows(vb, kr * svt, offs_d, kok, in_d)
        d = i[:, None] - kr[None, :]
        ok = (d >= 0) & (d <= WB) & kok[None, :] & row_ok[:, None]
        if HAS_DOCS:
            ok = ok & (d <= orow[:, None])
        # masked entries are set, not multiplied, to 0: a poisoned row's NaN delta must not reach them
        p = tl.where(ok, tl.exp2(_dot_t(q, k, IN, DOT).to(ACC) * qk_scale - lse[:, None]), 0.0)
        ds = tl.where(ok, p * (_dot_t(do, v, IN, DOT).to(ACC) - delta[:, None]), 0.0)
        dq = _mac(dq, ds, k, IN, DOT)
    return dq


@triton.jit
def _dq_rungs(dq, q, do, i0, OFF, b, kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, RN, PR, DSR, DFRAC, T, R, skt, svt, offs_d,
              in_d, qk_scale, sm_scale, lse, delta, rok, stat, TWO_TAP: tl.constexpr, NEED_DFRAC: tl.constexpr,
              HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr, DOT: tl.constexpr, RB: tl.constexpr,
              MC: tl.constexpr, C: tl.constexpr, CHECK: tl.constexpr):
    """The query pass over the rungs on ``(C, G·MC, ·)`` chunks: ``dq``, and the rungs' ``P``, ``dS`` and d loss / d
    frac stored per (row, head, rung)."""
    mc = tl.arange(0, q.shape[len(q.shape) - 2]) % MC
    mm = tl.arange(0, RB * MC) % MC
    nr = tl.load(RN)
    oc = _column_offsets(OFF, b, T, i0, MC, C, RB * MC, HAS_DOCS)
    for r0 in range(0, nr, RB):
        k1, v1, k2, v2, wlo, whi, kok, _ = _rung_keys(kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, r0, nr, i0, T, skt, svt,
                                                      offs_d, in_d, oc, TWO_TAP, HAS_DOCS, ACC, RB, MC, C, False,
                                                      CHECK)
        ok = (mc[:, None] == mm[None, :]) & _mid(kok) & _last(rok)
        s1 = _dot_t(q, k1, IN, DOT).to(ACC)
        dp1 = _dot_t(do, v1, IN, DOT).to(ACC)
        rr = r0 + tl.arange(0, RB)
        slot = _last(stat) * R + rr
        sok = _last(rok) & (rr < nr)
        if TWO_TAP:
            # the taps' differences, not the taps: d frac needs only them, and two blocks fewer stay live
            sd = _dot_t(q, k2, IN, DOT).to(ACC) - s1
            p = tl.where(ok, tl.exp2((s1 + whi * sd) * qk_scale - _last(lse)), 0.0)
            dpd = _dot_t(do, v2, IN, DOT).to(ACC) - dp1
            ds = tl.where(ok, p * (dp1 + whi * dpd - _last(delta)), 0.0)
            dq = _mac(_mac(dq, ds * wlo, k1, IN, DOT), ds * whi, k2, IN, DOT)
            # d frac's sums after the products: before them the chunks held 238 registers, after 178
            if NEED_DFRAC:      # d s / d frac = scale q.(k2 - k1), d out / d frac = p (v2 - v1); summed on the host
                # 0 off the block diagonal; unchecked, a non-finite sd or dpd can only be a row's own (its q or dout)
                part = ds * sd * sm_scale + p * dpd
                if CHECK:
                    part = tl.where(ok, part, 0.0)
                tl.store(DFRAC + slot, _per_rung_sum(part, RB, MC), mask=sok)
        else:
            p = tl.where(ok, tl.exp2(s1 * qk_scale - _last(lse)), 0.0)
            ds = tl.where(ok, p * (dp1 - _last(delta)), 0.0)
            dq = _mac(dq, ds, k1, IN, DOT)
        # one value per (row, rung): the block-diagonal mask leaves one entry per rung in a row
        tl.store(PR + slot, _per_rung_sum(p, RB, MC), mask=sok)
        tl.store(DSR + slot, _per_rung_sum(ds, RB, MC), mask=sok)
    return dq


@triton.jit
def _placed(diag, sup, on_diag, on_sup, IN: tl.constexpr, TWO_TAP: tl.constexpr, SELECT: tl.constexpr):
    """The key pass's ``A`` block: per column ``on_diag`` on the diagonal and, two-tap, ``on_sup`` on the
    superdiagonal, 0 elsewhere. ``SELECT`` (the checked launch; or the tile choice, ``PRODUCTS`` off): set, in the
    values' dtype, so that a NaN stays in the entries its row reads. Otherwise, where every value is finite, in
    ``IN``: the 0 / 1 blocks multiplied by the values, the same numbers, as two-lane half-precision products in
    place of a select and a conversion an element (the integer rung step 431 → 393 instructions a thread by the
    model), the 0 / 1 blocks held in registers."""
    if SELECT:
        if TWO_TAP:
            return tl.where(diag, on_diag[None, :], tl.where(sup, on_sup[None, :], 0.0))
        else:
            return tl.where(diag, on_diag[None, :], 0.0)
    else:
        a = diag.to(IN) * on_diag.to(IN)[None, :]
        if TWO_TAP:
            a = a + sup.to(IN) * on_sup.to(IN)[None, :]
        return a


@triton.jit
def _mac_placed(acc, diag, sup, on_diag, on_sup, x, IN: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr,
                TWO_TAP: tl.constexpr, SELECT: tl.constexpr):
    """``acc + A · x`` for ``A`` :func:`_placed` from probabilities, with ``SPLIT`` (half-precision inputs) as their
    ``hi + lo`` parts (``_mac_p``): of the block where it is selected, else of the values before they are placed
    (the same parts)."""
    if SELECT or not (SPLIT and (IN == tl.float16 or IN == tl.bfloat16)):
        return _mac_p(acc, _placed(diag, sup, on_diag, on_sup, IN, TWO_TAP, SELECT), x, IN, DOT, SPLIT)
    else:
        hd = on_diag.to(IN)
        hs = on_sup.to(IN)
        acc = _mac(acc, _placed(diag, sup, hd, hs, IN, TWO_TAP, SELECT), x, IN, DOT)
        return _mac(acc, _placed(diag, sup, on_diag - hd.to(on_diag.dtype), on_sup - hs.to(on_sup.dtype), IN,
                                 TWO_TAP, SELECT), x, IN, DOT)


@triton.jit(do_not_specialize=["T", "R", "WB"])
def bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, PR, DSR, FLAGS, RLO, RWLO, RWHI, RN, OFF,
                    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                    T, R, WB, HKV, H, GROUP, qk_scale, qk_lo, sm_scale, sm_lo,
                    TWO_TAP: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr,
                    DOT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, KEYS: tl.constexpr, RBK: tl.constexpr, PRODUCTS: tl.constexpr,
                    SPLIT_P: tl.constexpr, CHECK: tl.constexpr, DH: tl.constexpr, WIDE: tl.constexpr):
    """By key tile ``[j0, j0 + M)``: the band's query rows ``[j0, j0 + M + WB)`` recomputed as
    tile dots; rung ``r`` read by query rows ``j + lo`` (first tap, weight ``wlo``) and, two-tap,
    ``j + lo + 1`` (second, ``whi``) — plus query row ``lo``, whose clamped second tap reads key 0.
    A program owns the tile's first ``KEYS`` key rows (``triton_config.key_pass_rows``): two-tap
    ``M - 1``, as the last row's second tap would need a query row past the tile's gather; the
    next program, whose first row it is, writes it.
    ``HAS_DOCS``: the same, with each query row's own document offset ``off[i]`` in place of ``i``
    (a query at offset ``lo`` clamps its second tap onto its first).
    Launched twice, as the forward: ``CHECK`` for the heads some query row of which is unfinished
    (:func:`_any_unfinished`), each row's ``delta`` read and tested, and without for the others."""
    b, hk, j0 = _program(HKV, KEYS, WIDE)
    if _any_unfinished(FLAGS, b * HKV + hk, T) != CHECK:      # the other launch's head
        return
    qk_scale, sm_scale = _scale(qk_scale, qk_lo, ACC), _scale(sm_scale, sm_lo, ACC)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < DH
    kr = j0 + tl.arange(0, BLOCK_M)
    k_ok = kr < T
    k = _rows(K + b * skb + hk * skh, kr * skt, offs_d, k_ok, in_d).to(IN)
    v = _rows(V + b * svb + hk * svh, kr * svt, offs_d, k_ok, in_d).to(IN)
    dk = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_M, BLOCK_D], ACC)

    # the band: query rows (g, n0 + n) for blocks of BLOCK_Q positions (BLOCK_G x BLOCK_Q rows at a time)
    qn = tl.arange(0, BLOCK_G * BLOCK_Q)
    hq = hk * GROUP + qn // BLOCK_Q
    g_ok = (qn // BLOCK_Q) < GROUP
    for n0 in range(j0, j0 + BLOCK_M + WB, BLOCK_Q):
        i = n0 + qn % BLOCK_Q
        ok_i = g_ok & (i < T)
        stat = (b * H + hq) * T + i
        lse = tl.load(LSE + stat, mask=ok_i, other=0.0).to(ACC)
        delta = tl.load(DELTA + stat, mask=ok_i, other=0.0).to(ACC)
        rows_ok = ok_i
        if CHECK:
            off = delta != delta                          # unfinished rows (the query pass's NaN delta): their
            # q / dout rows must not meet other rows' zeros in a product (0 * NaN)
            rows_ok = ok_i & ~off
            lse = tl.where(off, float("nan"), lse)        # ... and give NaN where such a row attends
        qb = _rows(Q + b * sqb, hq * sqh + i * sqt, offs_d, rows_ok, in_d)
        dob = _rows(DO + b * sdb, hq * sdh + i * sdt, offs_d, rows_ok, in_d)
        d = i[None, :] - kr[:, None]                      # (key, query): the products come out as Pᵀ, dSᵀ
        ok = (d >= 0) & (d <= WB) & ok_i[None, :] & k_ok[:, None]
        if HAS_DOCS:
            ok = ok & (d <= _doc_off(OFF, b, T, i, HAS_DOCS)[None, :])
        pt = tl.where(ok, tl.exp2(_dot_t(k, qb, IN, DOT).to(ACC) * qk_scale - lse[None, :]), 0.0)
        dst = tl.where(ok, pt * (_dot_t(v, dob, IN, DOT).to(ACC) - delta[None, :]), 0.0)
        dv = _mac_p(dv, pt, dob, IN, DOT, SPLIT_P)
        dk = _mac(dk, dst, qb, IN, DOT)

    # the rungs, from the stored P and dS: key row j0 + m reads query rows (g, j0 + m + lo) through
    # its first tap and (g, j0 + m + lo + 1) through its second — the gathered rows of tile
    # row m + 1 — so one gather serves both: A = wlo·diag(dS) + whi·superdiag(dS) (and key 0 also
    # takes row lo's clamped second tap); key row j0 + M - 1, whose second tap is past the gather,
    # is left to the next program.
    rq = tl.arange(0, RBK * BLOCK_G * BLOCK_M)          # RBK rungs a step, each G·M gathered query rows
    m = rq % BLOCK_M
    h = hk * GROUP + (rq // BLOCK_M) % BLOCK_G
    gm_ok = ((rq // BLOCK_M) % BLOCK_G) < GROUP
    row = tl.arange(0, BLOCK_M)
    diag = row[:, None] == m[None, :]
    sup = row[:, None] + 1 == m[None, :]
    nr = tl.load(RN)
    SELECT: tl.constexpr = CHECK or not PRODUCTS
    for r0 in range(0, nr, RBK):
        rung = r0 + rq // (BLOCK_G * BLOCK_M)
        lo = _per_rung(RLO, r0, nr, _NEVER, tl.int32, RBK, BLOCK_G * BLOCK_M)
        iq = j0 + m + lo                                # past T for a slot past the rungs in use (lo NEVER)
        qg, dog, ds, p = _stored(Q, DO, PR, DSR, DELTA, b, h, iq, gm_ok, rung, R, T, H, sqb, sqh, sqt, sdb, sdh,
                                 sdt, offs_d, in_d, CHECK)
        if TWO_TAP:
            wlo = _per_rung(RWLO, r0, nr, 1.0, ACC, RBK, BLOCK_G * BLOCK_M)
            whi = _per_rung(RWHI, r0, nr, 0.0, ACC, RBK, BLOCK_G * BLOCK_M)
            # a query at offset lo (in its document; without documents the query row lo itself, whose second tap is
            # clamped onto key 0): both taps on key j (the diagonal), none on j - 1. Weighted per column, then
            # placed: the superdiagonal's entry is set to 0, not multiplied by it, where a row has no second tap
            # there (a NaN dS or P stays in the entries its row reads)
            oq = _doc_off(OFF, b, T, iq, HAS_DOCS)
            wd = wlo + whi * (oq == lo).to(ACC)
            two = oq > lo
            dk = _mac(dk, _placed(diag, sup, wd * ds, tl.where(two, whi * ds, 0.0), IN, True, SELECT), qg, IN, DOT)
            dv = _mac_placed(dv, diag, sup, wd * p, tl.where(two, whi * p, 0.0), dog, IN, DOT, SPLIT_P, True, SELECT)
        else:
            dk = _mac(dk, _placed(diag, sup, ds, ds, IN, False, SELECT), qg, IN, DOT)
            dv = _mac_placed(dv, diag, sup, p, p, dog, IN, DOT, SPLIT_P, False, SELECT)
    own = k_ok & (row < KEYS)
    tl.store(DK + b * sdkb + hk * sdkh + kr[:, None] * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=own[:, None] & in_d[None, :])
    tl.store(DV + b * sdvb + hk * sdvh + kr[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=own[:, None] & in_d[None, :])
