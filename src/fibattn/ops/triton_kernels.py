"""Triton kernels of the ``triton`` backend: a tensor-core window band plus rung tiles.

Imported only by :mod:`fibattn.ops.triton_backend`, after ``TRITON_INTERPRET`` is settled
(Triton reads it when a kernel is defined).

Layout: q, out, dout ``(B, H, T, Dh)``; k, v ``(B, Hkv, T, Dh)``, unit stride on ``Dh``;
``lse`` and ``delta`` ``(B, H, T)`` in the accumulation dtype (float32; float64 for float64
inputs). Query head ``h`` reads key/value head ``h // GROUP``.

**Unit of work.** A program owns ``BLOCK_M`` consecutive rows ``[i0, i0 + M)`` of one
key/value head and stacks the ``GROUP`` query heads that read it as the ``G·M`` rows of one
2-D tile (row ``r`` is head ``r // M``, position ``i0 + r % M``), so every key/value row it
loads serves the whole group and every product is a ``tl.dot`` (tensor cores):

- **the band** — distances ``0..WB`` (the window, method.md §1) — is ``WB + 1`` diagonals of
  the ``(G·M) × (M + WB)`` block of key rows ``[i0 - WB, i0 + M)``: FlashAttention over
  ``BLOCK_N`` keys at a time with a diagonal-band mask;
- **the rungs** — the ``R`` other distances ``lo_r`` — read, for row ``i0 + m``, key row
  ``i0 + m - lo_r``. The forward and the query pass take them in chunks of ``MC`` positions
  (``triton_config.rung_chunk``; ``G·MC = 16`` rows): ``RB`` rungs at once are, per chunk, one
  gathered block of ``RB·MC`` key rows, and a batched ``Q · Kᵀ`` over the ``C = M / MC`` chunks
  keeps only the entries whose row and key share their position (a block-diagonal mask). That
  spends ``MC``× the useful multiply-adds, on tensor cores, instead of a cross-lane reduction
  per column — and ``MC``×, not ``M``×, the softmax's elementwise work. Tile rows go chunk by
  chunk (:func:`_tile`), so the band's ``(G·M, ·)`` blocks are the rungs' ``(C, G·MC, ·)`` ones
  reshaped; one chunk (``MC = M``) keeps 2-D blocks. The key pass takes a block of
  ``RBK·G·M`` gathered query rows per step, block-diagonal the same way (``M``×);
- one online-softmax update per block (band block or rung block), not per column;
- every product that adds into an accumulator hands it to ``tl.dot`` (``_mac``): the tensor
  cores add it, not one add per element and thread.

Interpolated rungs (``TWO_TAP``, method.md §3) read ``wlo·x[i - lo] + whi·x[max(i - lo - 1, 0)]``;
both taps are always read so that the gradient of ``frac`` exists at ``frac = 0``, and the taps
are mixed as scores and probabilities, never as rounded rows. The rungs in use (``RN`` of the
``R`` slots, packed at the front by ``plan_kernel``) are read on the device.

**Backward.** ``bwd_dq_kernel`` (by query tile) recomputes ``P`` and ``dS`` once, writes ``dq``,
``delta`` and — for the rungs only — ``P``, ``dS`` (and d loss / d frac) per (row, head, rung
slot) (``(B·H·T, R)`` float32 each). ``bwd_dkdv_kernel`` (by key tile) recomputes the band as
tile dots (``dSᵀ·Q``, ``Pᵀ·dO``) and turns the stored rung values into the same dots over
gathered query rows — no second recomputation of rung scores. Every result is written by one
program: no atomics, deterministic.

**Non-finite rows.** ``flags_kernel`` marks the key and value rows holding a NaN or inf, and
each head that has one. The forward and the query pass are launched twice (``CHECK``): once
unchecked, for the heads without any, reading no flags; once checked, for the others, where a
flagged row is kept from the queries that do not read it (:func:`_flagged`). Each program
leaves at once where its head is the other launch's.

**Documents** (``HAS_DOCS``, a compile-time flag: the kernels without it are unchanged): ``OFF``
``(B, T)`` int32 holds each position's offset in its document, and every rule above that reads
a query row ``i`` as "keys ``0..i`` exist" reads ``off[i]`` instead: key ``i - d`` is valid when
``d <= off[i]``, and a second tap is clamped at the document's start (row ``i - min(lo + 1, off[i])``).

Scores are kept in base 2 (``qk_scale = scale · log2 e``); ``lse`` is in those units. ``T``,
``WB`` and the rung count are runtime values: a new length never recompiles. docs/gpu.md has
the compiled code's instruction mix (``tools/gpu_static.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import (
    _NEVER,
    NEVER,
    _any_flagged,
    _doc_off,
    _dot_t,
    _flagged,
    _last,
    _mac,
    _mac_p,
    _mid,
    _per_rung,
    _rows,
    _rung_keys,
    _softmax_step,
    _stored,
    _unfinished,
)

__all__ = ["NEVER", "plan_kernel", "flags_kernel", "fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel"]


@triton.jit(do_not_specialize=["CAP"])
def plan_kernel(ALPHA, BASE, RLO, RWLO, RWHI, RBASE, RN, K, CAP, W: tl.constexpr, BLOCK_K: tl.constexpr):
    """method.md §3 on the device: the rungs in use at this ``alpha``, packed at the front.

    A rung ``b`` has target ``t = alpha * b`` (float64, as Python computes it), ``lo =
    floor(t)``; it is used when ``W < lo <= CAP`` and no earlier used rung has the same
    ``lo`` (``round(t) > W`` follows from ``lo > W``). The used rungs' ``lo``, weights and base
    values fill slots ``0..RN-1`` in base order, so that the kernels loop over ``RN`` rungs,
    not over the whole base; the other slots get ``lo = NEVER``.
    """
    alpha = tl.load(ALPHA).to(tl.float64)
    offs_k = tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    b = tl.load(BASE + offs_k, mask=in_k, other=0).to(tl.float64)
    t = alpha * b
    lo = t.to(tl.int64)                      # t >= 0: truncation is floor
    cand = in_k & (lo > W) & (lo <= CAP)
    before = offs_k[:, None] < offs_k[None, :]          # [k', k]: k' comes before k
    dup = tl.sum((before & cand[:, None] & (lo[:, None] == lo[None, :])).to(tl.int32), axis=0) > 0
    used = cand & (dup == 0)
    slot = tl.sum((before & used[:, None]).to(tl.int32), axis=0)           # used rungs before k
    pick = used[:, None] & (slot[:, None] == offs_k[None, :])             # [k, j]: rung k goes to slot j
    filled = tl.sum(pick.to(tl.int32), axis=0) > 0
    frac = t - lo.to(tl.float64)
    lo_j = tl.sum(tl.where(pick, lo[:, None], 0), axis=0)
    tl.store(RLO + offs_k, tl.where(filled, lo_j, _NEVER).to(tl.int32), mask=in_k)
    tl.store(RWLO + offs_k, tl.sum(tl.where(pick, 1.0 - frac[:, None], 0.0), axis=0), mask=in_k)
    tl.store(RWHI + offs_k, tl.sum(tl.where(pick, frac[:, None], 0.0), axis=0), mask=in_k)
    tl.store(RBASE + offs_k, tl.sum(tl.where(pick, b[:, None], 0.0), axis=0), mask=in_k)
    tl.store(RN, tl.sum(used.to(tl.int32), axis=0))


@triton.jit
def flags_kernel(K, V, FLAGS, skb, skh, skt, svb, svh, svt, T, HKV, DH, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """``FLAGS[b, hk, t]`` (int32, ``T + 1`` a head): bit 0 when key row ``(b, hk, t)`` holds a NaN or inf, bit 1
    when its value row does (``_flagged``), and at ``t = T`` the OR of the head's rows: one read of K and V, so
    that the attention kernels test a flag per row, not each element, a non-finite value reaches only the queries
    that attend it, and a head without one is read without any test (``_any_flagged``)."""
    b = tl.program_id(1) // HKV
    hk = tl.program_id(1) % HKV
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = t < T
    k = _rows(K + b.to(tl.int64) * skb + hk * skh, t * skt, offs_d, ok, offs_d < DH)
    v = _rows(V + b.to(tl.int64) * svb + hk * svh, t * svt, offs_d, ok, offs_d < DH)
    kbad = tl.max(tl.where(tl.abs(k.to(tl.float32)) < float("inf"), 0, 1), axis=1)
    vbad = tl.max(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 0, 2), axis=1)
    tl.store(FLAGS + tl.program_id(1) * (T + 1) + t, kbad | vbad, mask=ok)
    # the head's summary (after its T rows, zeroed by the host): an OR, the same whichever program comes first
    head = tl.max(kbad | vbad, axis=0)
    tl.atomic_or(FLAGS + tl.program_id(1) * (T + 1) + T, head, mask=head != 0)


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _scale(hi, lo, ACC: tl.constexpr):
    """A scale passed as two float32 numbers (a Python float argument is typed float32): ``hi`` alone for float32
    accumulation, ``hi + lo`` in float64 — the float64 scale to 2**-48 — for float64 inputs."""
    if ACC == tl.float64:
        return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        return hi


@triton.jit
def _tile(T, HKV, GROUP, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, MC: tl.constexpr):
    """This program's batch ``b``, key/value head ``hk``, first row ``i0``, and per tile row
    ``r``: its position in the tile ``m``, its query head ``h`` and whether it exists. Rows go
    chunk by chunk (the rung chunks: ``r = c·G·MC + g·MC + mc`` is head ``g`` at ``m = c·MC + mc``), so that
    the ``(G·M, ·)`` band blocks reshape to ``(C, G·MC, ·)`` rung blocks as they are."""
    b = (tl.program_id(1) // HKV).to(tl.int64)      # int64 offsets: B * H * T * Dh may exceed 2**31
    hk = tl.program_id(1) % HKV
    i0 = tl.program_id(0) * BLOCK_M
    r = tl.arange(0, BLOCK_G * BLOCK_M)
    g = (r // MC) % BLOCK_G
    m = r // (BLOCK_G * MC) * MC + r % MC
    return b, hk, i0, m, hk * GROUP + g, (g < GROUP) & (i0 + m < T)


@triton.jit
def _chunks(x, C: tl.constexpr, GMC: tl.constexpr):
    """A per-tile-row block ``(G·M, ...)`` as ``(C, G·MC, ...)`` chunks (:func:`_tile`'s row order); one chunk
    stays as it is (the rung steps take either rank)."""
    if C == 1:
        return x
    elif len(x.shape) == 2:
        return tl.reshape(x, [C, GMC, x.shape[1]])
    else:
        return tl.reshape(x, [C, GMC])


@triton.jit
def _any(x):
    """Whether any element of a 1- or 2-D block is nonzero."""
    if len(x.shape) == 2:
        return tl.max(tl.max(x.to(tl.int32), axis=1), axis=0) > 0
    else:
        return tl.max(x.to(tl.int32), axis=0) > 0


@triton.jit
def _per_rung_sum(x, RB: tl.constexpr, MC: tl.constexpr):
    """A rung block's ``(..., rows, RB·MC)`` values summed per rung: its one entry a row and rung (the rest are 0,
    off the block diagonal)."""
    if len(x.shape) == 3:
        return tl.sum(tl.reshape(x, [x.shape[0], x.shape[1], RB, MC]), axis=3)
    else:
        return tl.sum(tl.reshape(x, [x.shape[0], RB, MC]), axis=2)


@triton.jit
def _chunk_rows(h0, i0, T, GROUP, BLOCK_G: tl.constexpr, MC: tl.constexpr, C: tl.constexpr):
    """:func:`_tile`'s query head, position and existence of each row, as ``(C, G·MC)`` chunks (:func:`_chunks`)."""
    r = tl.arange(0, BLOCK_G * MC)
    g = r // MC
    if C == 1:
        i = i0 + r % MC
    else:
        i = i0 + tl.arange(0, C)[:, None] * MC + (r % MC)[None, :]
    return h0 + g, i, (g < GROUP) & (i < T)


# ----------------------------------------------------------------------------- forward
@triton.jit(do_not_specialize=["T", "WB"])
def fwd_kernel(Q, K, V, OUT, LSE, FLAGS, RLO, RWLO, RWHI, RN, OFF,
               sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
               T, WB, HKV, H, GROUP, DH, qk_scale, qk_lo,
               TWO_TAP: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr, DOT: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, RB: tl.constexpr, MC: tl.constexpr, SPLIT_P: tl.constexpr,
               CHECK: tl.constexpr):
    """By query tile: the output and ``lse``. Launched twice (:func:`_checked`): ``CHECK`` for the heads whose
    keys or values hold a NaN or inf, each row read checked, and without for the others, nothing checked."""
    C: tl.constexpr = BLOCK_M // MC
    GMC: tl.constexpr = BLOCK_G * MC
    b, hk, i0, m, h, row_ok = _tile(T, HKV, GROUP, BLOCK_G, BLOCK_M, MC)
    qk_scale = _scale(qk_scale, qk_lo, ACC)
    i = i0 + m
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < DH
    q = _rows(Q + b * sqb, h * sqh + i * sqt, offs_d, row_ok, in_d).to(IN)
    orow = _doc_off(OFF, b, T, i, HAS_DOCS)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh
    bhk = b * HKV + hk
    if _any_flagged(FLAGS, bhk, T) != CHECK:          # the other launch's head
        return
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
        k1, v1, k2, v2, wlo, whi, kok, cbad = _rung_keys(kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, r0, nr, i0, T,
                                                             skt, svt, offs_d, in_d, OFF, b, TWO_TAP, HAS_DOCS, ACC,
                                                             RB, MC, C, True, CHECK)
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


# ----------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=["T", "R", "WB"])
def bwd_dq_kernel(Q, K, V, OUT, DO, LSE, DELTA, DQ, PR, DSR, DFRAC, FLAGS, RLO, RWLO, RWHI, RN, OFF,
                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdb, sdh, sdt,
                  sdqb, sdqh, sdqt, T, R, WB, HKV, H, GROUP, DH, qk_scale, qk_lo, sm_scale, sm_lo,
                  TWO_TAP: tl.constexpr, NEED_DFRAC: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr,
                  IN: tl.constexpr, DOT: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, RB: tl.constexpr, MC: tl.constexpr, CHECK: tl.constexpr):
    """By query tile: ``delta = rowsum(dout * out)`` (stored for the key pass), ``dq``, the
    rungs' ``P`` and ``dS`` per (row, head, rung), and the per-program sums of d loss / d frac. Launched twice,
    ``CHECK`` as the forward's."""
    C: tl.constexpr = BLOCK_M // MC
    GMC: tl.constexpr = BLOCK_G * MC
    b, hk, i0, m, h, row_ok = _tile(T, HKV, GROUP, BLOCK_G, BLOCK_M, MC)
    if _any_flagged(FLAGS, b * HKV + hk, T) != CHECK:          # the other launch's head
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
    # the key pass reads a NaN delta as "this row is unfinished" (a NaN / inf in its q, dout or a row it read)
    tl.store(DELTA + stat, tl.where(_unfinished(lse, delta), float("nan"), delta).to(DELTA.dtype.element_ty),
             mask=row_ok)
    q = q.to(IN)
    do = do.to(IN)
    orow = _doc_off(OFF, b, T, i, HAS_DOCS)
    kb = K + b * skb + hk * skh
    vb = V + b * svb + hk * svh
    bhk = b * HKV + hk

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
    for r0 in range(0, nr, RB):
        k1, v1, k2, v2, wlo, whi, kok, _ = _rung_keys(kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, r0, nr, i0, T, skt,
                                                          svt, offs_d, in_d, OFF, b, TWO_TAP, HAS_DOCS, ACC, RB, MC, C,
                                                          False, CHECK)
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
            # (after the products: before them, 238 registers where after, 178)
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
def _taps(diag, sup, on_diag, on_sup):
    """The key pass's ``A`` block: per column ``on_diag`` on the diagonal, ``on_sup`` on the superdiagonal, 0
    elsewhere (set, not multiplied)."""
    return tl.where(diag, on_diag[None, :], tl.where(sup, on_sup[None, :], 0.0))


@triton.jit(do_not_specialize=["T", "R", "WB"])
def bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, PR, DSR, RLO, RWLO, RWHI, RN, OFF,
                    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                    T, R, WB, HKV, H, GROUP, DH, qk_scale, qk_lo, sm_scale, sm_lo,
                    TWO_TAP: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr, IN: tl.constexpr,
                    DOT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, KEYS: tl.constexpr, RBK: tl.constexpr, SPLIT_P: tl.constexpr):
    """By key tile ``[j0, j0 + M)``: the band's query rows ``[j0, j0 + M + WB)`` recomputed as
    tile dots; rung ``r`` read by query rows ``j + lo`` (first tap, weight ``wlo``) and, two-tap,
    ``j + lo + 1`` (second, ``whi``) — plus query row ``lo``, whose clamped second tap reads key 0.
    A program owns the tile's first ``KEYS`` key rows (``triton_config.key_pass_rows``): two-tap
    ``M - 1``, as the last row's second tap would need a query row past the tile's gather; the
    next program, whose first row it is, writes it.
    ``HAS_DOCS``: the same, with each query row's own document offset ``off[i]`` in place of ``i``
    (a query at offset ``lo`` clamps its second tap onto its first)."""
    b = (tl.program_id(1) // HKV).to(tl.int64)
    hk = tl.program_id(1) % HKV
    j0 = tl.program_id(0) * KEYS
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
        off = delta != delta                              # unfinished rows (the query pass's NaN delta): their
        # q / dout rows must not meet other rows' zeros in a product (0 * NaN)
        qb = _rows(Q + b * sqb, hq * sqh + i * sqt, offs_d, ok_i & ~off, in_d)
        dob = _rows(DO + b * sdb, hq * sdh + i * sdt, offs_d, ok_i & ~off, in_d)
        lse = tl.where(off, float("nan"), lse)            # ... and give NaN where such a row attends
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
    for r0 in range(0, nr, RBK):
        rung = r0 + rq // (BLOCK_G * BLOCK_M)
        lo = _per_rung(RLO, r0, nr, _NEVER, tl.int32, RBK, BLOCK_G * BLOCK_M)
        iq = j0 + m + lo                                # past T for a slot past the rungs in use (lo NEVER)
        qg, dog, ds, p = _stored(Q, DO, PR, DSR, DELTA, b, h, iq, gm_ok, rung, R, T, H, sqb, sqh, sqt, sdb, sdh,
                                 sdt, offs_d, in_d)
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
            dk = _mac(dk, _taps(diag, sup, wd * ds, tl.where(two, whi * ds, 0.0)), qg, IN, DOT)
            dv = _mac_p(dv, _taps(diag, sup, wd * p, tl.where(two, whi * p, 0.0)), dog, IN, DOT, SPLIT_P)
        else:
            dk = _mac(dk, tl.where(diag, ds[None, :], 0.0), qg, IN, DOT)
            dv = _mac_p(dv, tl.where(diag, p[None, :], 0.0), dog, IN, DOT, SPLIT_P)
    own = k_ok & (row < KEYS)
    tl.store(DK + b * sdkb + hk * sdkh + kr[:, None] * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=own[:, None] & in_d[None, :])
    tl.store(DV + b * sdvb + hk * sdvh + kr[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=own[:, None] & in_d[None, :])
