"""The ``triton`` backend's forward kernel: by query tile, the band then the rung chunks' online softmax.
Layout, unit of work and method: :mod:`fibattn.ops.triton_kernels`, which alone imports this module.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import (
    _any,
    _any_flagged,
    _chunk_rows,
    _chunks,
    _column_offsets,
    _doc_off,
    _dot_t,
    _flagged,
    _last,
    _mac_p,
    _mid,
    _rows,
    _rung_keys,
    _scale,
    _softmax_step,
    _tile,
)


@triton.jit(do_not_specialize=["T", "WB"])
def fwd_kernel(Q, K, V, OUT, LSE, FLAGS, RLO, RWLO, RWHI, RN, OFF,
               sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
               T, WB, HKV, H, GROUP, qk_scale, qk_lo,
               TWO_TAP: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr, DOT: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, RB: tl.constexpr, MC: tl.constexpr, SPLIT_P: tl.constexpr,
               CHECK: tl.constexpr, DH: tl.constexpr, WIDE: tl.constexpr):
    """By query tile: the output and ``lse``. Launched twice (``triton_backend._CHECKED``): ``CHECK`` for the heads
    whose keys or values hold a NaN or inf, each row read checked, and without for the others, nothing checked."""
    C: tl.constexpr = BLOCK_M // MC
    GMC: tl.constexpr = BLOCK_G * MC
    b, hk, i0, m, h, row_ok = _tile(T, HKV, GROUP, BLOCK_G, BLOCK_M, MC, WIDE)
    bhk = b * HKV + hk
    if _any_flagged(FLAGS, bhk, T) != CHECK:          # the other launch's head
        return
    qk_scale = _scale(qk_scale, qk_lo, ACC)
    i = i0 + m
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < DH
    q = _rows(Q + b * sqb, h * sqh + i * sqt, offs_d, row_ok, in_d).to(IN)
    orow = _doc_off(OFF, b, T, i, HAS_DOCS)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_G * BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_G * BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_G * BLOCK_M, BLOCK_D], ACC)
    bad = tl.zeros([BLOCK_G * BLOCK_M], tl.int32)      # rows that attend a value row holding a NaN / inf
    m_i, l_i, acc, bad = _fwd_band(m_i, l_i, acc, bad, q, i, i0, orow, kb, vb, FLAGS, bhk, T, WB, skt, svt, offs_d,
                                   in_d, qk_scale, HAS_DOCS, ACC, IN, DOT, BLOCK_M, BLOCK_N, SPLIT_P, CHECK)
    # the rungs, RB at a time, chunk by chunk: (C, G·MC, ·) blocks
    q, m_i, l_i, acc, bad = _chunks(q, C, GMC), _chunks(m_i, C, GMC), _chunks(l_i, C, GMC), _chunks(acc, C, GMC), \
        _chunks(bad, C, GMC)
    m_i, l_i, acc, bad = _fwd_rungs(m_i, l_i, acc, bad, q, i0, OFF, b, kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, RN, T, skt,
                                    svt, offs_d, in_d, qk_scale, TWO_TAP, HAS_DOCS, ACC, IN, DOT, RB, MC, C, SPLIT_P,
                                    CHECK)
    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    # one division a row, then a product an element (an element's IEEE division costs ~3 instructions more)
    out = tl.where(_last(bad) > 0, float("nan"), acc * _last(1.0 / l_use))
    h, i, row_ok = _chunk_rows(hk * GROUP, i0, T, GROUP, BLOCK_G, MC, C)      # stored as chunks: no reshape back
    tl.store(OUT + b * sob + _last(h * soh + i * sot) + offs_d, out.to(OUT.dtype.element_ty),
             mask=_last(row_ok) & in_d)
    lse = tl.where(bad > 0, float("nan"), m_i + tl.log2(l_use))
    tl.store(LSE + (b * H + h) * T + i, lse.to(LSE.dtype.element_ty), mask=row_ok)


@triton.jit
def _fwd_band(m_i, l_i, acc, bad, q, i, i0, orow, kb, vb, FLAGS, bhk, T, WB, skt, svt, offs_d, in_d, qk_scale,
              HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLIT_P: tl.constexpr, CHECK: tl.constexpr):
    """The forward's online softmax over the band, keys ``[i0 - WB, i0 + M)``; ``bad``: the rows that attend a value
    row holding a NaN / inf. ``CHECK``: some key or value row of this head is flagged (:func:`_any_flagged`), so
    each row read is checked; without, none is."""
    for n0 in range(i0 - WB, i0 + BLOCK_M, BLOCK_N):        # the band: keys [i0 - WB, i0 + M)
        kr = n0 + tl.arange(0, BLOCK_N)
        kok = (kr >= 0) & (kr < T)
        vbad = _flagged(FLAGS, bhk, T, kr, kok, 2, CHECK)
        k = _rows(kb, kr * skt, offs_d, kok, in_d)
        v = _rows(vb, kr * svt, offs_d, kok & ~vbad, in_d)
        d = i[:, None] - kr[None, :]
        ok = (d >= 0) & (d <= WB) & kok[None, :]
        if HAS_DOCS:
            ok = ok & (d <= orow[:, None])
        if CHECK:
            if tl.max(vbad.to(tl.int32), axis=0) > 0:            # rare: a flagged value row in this block
                bad = tl.maximum(bad, tl.max(tl.where(ok & vbad[None, :], 1, 0), axis=1))
        s = tl.where(ok, _dot_t(q, k, IN, DOT).to(ACC) * qk_scale, float("-inf"))
        m_i, l_i, acc, p = _softmax_step(m_i, l_i, acc, s)
        acc = _mac_p(acc, p, v, IN, DOT, SPLIT_P)
    return m_i, l_i, acc, bad


@triton.jit
def _fwd_rungs(m_i, l_i, acc, bad, q, i0, OFF, b, kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, RN, T, skt, svt, offs_d, in_d,
               qk_scale, TWO_TAP: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr,
               DOT: tl.constexpr, RB: tl.constexpr, MC: tl.constexpr, C: tl.constexpr, SPLIT_P: tl.constexpr,
               CHECK: tl.constexpr):
    """:func:`_fwd_band`'s online softmax continued over the rungs, ``RB`` at a time, on ``(C, G·MC, ·)``
    chunks."""
    mc = tl.arange(0, q.shape[len(q.shape) - 2]) % MC         # each row's position in its chunk
    mm = tl.arange(0, RB * MC) % MC                           # each column's
    nr = tl.load(RN)
    for r0 in range(0, nr, RB):                               # the rungs, RB at a time
        oc = _column_offsets(OFF, b, T, i0, MC, C, RB * MC, HAS_DOCS)          # read each step: see there
        k1, v1, k2, v2, wlo, whi, kok, cbad = _rung_keys(kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, r0, nr, i0, T, skt,
                                                         svt, offs_d, in_d, oc, TWO_TAP, HAS_DOCS, ACC, RB, MC,
                                                         C, True, CHECK)
        ok = (mc[:, None] == mm[None, :]) & _mid(kok)
        if CHECK:
            if _any(cbad):
                bad = tl.maximum(bad, tl.max(tl.where(ok & _mid(cbad), 1, 0), axis=len(ok.shape) - 1))
        if TWO_TAP:
            s1 = _dot_t(q, k1, IN, DOT).to(ACC)
            s = s1 + whi * (_dot_t(q, k2, IN, DOT).to(ACC) - s1)      # as the query pass has it
        else:
            s = _dot_t(q, k1, IN, DOT).to(ACC)
        m_i, l_i, acc, p = _softmax_step(m_i, l_i, acc, tl.where(ok, s * qk_scale, float("-inf")))
        if TWO_TAP:
            acc = _mac_p(_mac_p(acc, p * wlo, v1, IN, DOT, SPLIT_P), p * whi, v2, IN, DOT, SPLIT_P)
        else:
            acc = _mac_p(acc, p, v1, IN, DOT, SPLIT_P)
    return m_i, l_i, acc, bad
