"""Tile-level building blocks of the ``triton`` kernels (:mod:`fibattn.ops.triton_kernels`):
row gathers, tensor-core products, the online-softmax step, the rungs' gathered key blocks and
the key pass's stored rung values. Imported only through ``triton_kernels`` (after
``TRITON_INTERPRET`` is settled).
"""
from __future__ import annotations

import triton
import triton.language as tl

NEVER = 1 << 30       # lo of a rung that is never valid (not used at this alpha)
_NEVER = tl.constexpr(NEVER)


@triton.jit
def _rows(base, offs, offs_d, ok, in_d):
    """A ``(rows, Dh)`` block (``(chunks, rows, Dh)`` for 2-D ``offs``): row ``r`` starts at element ``offs[r]`` of
    ``base``."""
    return tl.load(base + _last(offs) + offs_d, mask=_last(ok) & in_d, other=0.0)


@triton.jit
def _last(x):
    """``x`` with a new last axis of size 1 (``x[..., None]`` at any rank)."""
    return tl.expand_dims(x, len(x.shape))


@triton.jit
def _mid(x):
    """``x`` with a new axis of size 1 before its last (``x[..., None, :]`` at any rank)."""
    return tl.expand_dims(x, len(x.shape) - 1)


@triton.jit
def _chunk_cols(i0, MC: tl.constexpr, C: tl.constexpr, N: tl.constexpr):
    """The tile position each of a rung block's ``N`` columns serves (column ``n`` of chunk ``c``: ``c·MC + n %
    MC``): ``(C, N)``, or ``(N,)`` for one chunk (``_chunks``)."""
    mm = tl.arange(0, N) % MC
    if C == 1:
        return i0 + mm
    else:
        return i0 + tl.arange(0, C)[:, None] * MC + mm[None, :]


@triton.jit
def _head_flags(FLAGS, bhk, T):
    """Head ``bhk``'s flags (``b * Hkv + hk``): one a key/value row, then two summaries — at ``T`` whether any of
    its key or value rows holds a NaN or inf (:func:`_any_flagged`), at ``T + 1`` whether any of its query rows is
    unfinished (:func:`_any_unfinished`)."""
    return FLAGS + bhk * (T + 2)


@triton.jit
def _flagged(FLAGS, bhk, T, rows, ok, BIT: tl.constexpr, CHECK: tl.constexpr):
    """Whether key/value rows ``rows`` of head ``bhk`` (``b * Hkv + hk``) hold a NaN or inf: bit ``BIT`` of their
    flags (``flags_kernel``; 1 keys, 2 values); never, without reading them, unless ``CHECK`` (a head some row of
    which is flagged: :func:`_any_flagged`).

    A row another query of the tile reads but this one does not still meets this one in a tile product
    (``0 * NaN`` = NaN), so a flagged row is loaded as zeros wherever it is a product's right-hand operand —
    values in the forward, keys in the query pass — and a query that does read a flagged value row is given
    NaN explicitly. Scores need nothing: a masked one is selected away, not multiplied."""
    if CHECK:
        return (tl.load(_head_flags(FLAGS, bhk, T) + rows, mask=ok, other=0) & BIT) != 0
    else:
        return tl.zeros(rows.shape, tl.int1)


@triton.jit
def _any_flagged(FLAGS, bhk, T):
    """Whether any key or value row of head ``bhk`` holds a NaN or inf (``flags_kernel``'s summary): the kernels
    take their checked loops (``CHECK``) only then, and without it skip the per-row flags' reads and tests."""
    return tl.load(_head_flags(FLAGS, bhk, T) + T) != 0


@triton.jit
def _any_unfinished(FLAGS, bhk, T):
    """Whether any query row of the heads of ``bhk`` is unfinished (:func:`_unfinished`; set by the query pass):
    the key pass takes its checked loops (``CHECK``) only then, and without it reads no row's ``delta`` to test."""
    return tl.load(_head_flags(FLAGS, bhk, T) + T + 1) != 0


@triton.jit
def _unfinished(lse, delta):
    """Query rows whose output or gradient is not finite (a NaN / inf in q, dout, or a row they read): their
    q and dout rows are loaded as zeros in the key pass, and their probabilities made NaN where they attend."""
    return ((lse - lse) != 0) | ((delta - delta) != 0)


@triton.jit
def _dot(a, b, IN: tl.constexpr, DOT: tl.constexpr):
    """A tensor-core product of operands rounded to the input dtype ``IN``, in ``DOT`` (``IN``
    itself; float32 under the interpreter for bfloat16, whose products it gets wrong), with
    exact (not tf32) products for float32."""
    a = a.to(IN).to(DOT)
    b = b.to(IN).to(DOT)
    if DOT == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mac(acc, a, b, IN: tl.constexpr, DOT: tl.constexpr):
    """``acc + a · b`` (as :func:`_dot`), added by the product itself: the tensor cores accumulate into ``acc``,
    where a separate ``+`` costs one add per accumulator element and thread (32 for a 64 x 64 tile)."""
    a = a.to(IN).to(DOT)
    b = b.to(IN).to(DOT)
    if DOT == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mac_p(acc, p, x, IN: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr):
    """``acc + p · x`` for probabilities (or their weighted copies) ``p`` in float32. With
    half-precision inputs ``p`` goes in as two half-precision parts, ``hi + lo``, so that the
    output keeps float32 probabilities' accuracy for one more tensor-core product (``SPLIT``;
    off only to time what the split costs: ``FIBATTN_TRITON_SPLIT_P=0``)."""
    if SPLIT and (IN == tl.float16 or IN == tl.bfloat16):
        hi = p.to(IN)
        return _mac(_mac(acc, hi, x, IN, DOT), p - hi.to(p.dtype), x, IN, DOT)
    else:
        return _mac(acc, p, x, IN, DOT)


@triton.jit
def _dot_t(a, b, IN: tl.constexpr, DOT: tl.constexpr):
    """``a · bᵀ`` (per chunk for 3-D blocks)."""
    if len(b.shape) == 3:
        return _dot(a, tl.permute(b, (0, 2, 1)), IN, DOT)
    else:
        return _dot(a, tl.trans(b), IN, DOT)


@triton.jit
def _softmax_step(m_i, l_i, acc, s):
    """One online-softmax update with the ``(rows, N)`` block ``s`` (``(chunks, rows, N)``; base 2, -inf where
    masked): the new max and sum, the rescaled accumulator and the block's probabilities."""
    ax: tl.constexpr = len(s.shape) - 1
    m_new = tl.maximum(m_i, tl.max(s, axis=ax))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    corr = tl.exp2(m_i - m_use)
    p = tl.exp2(s - _last(m_use))
    return m_new, l_i * corr + tl.sum(p, axis=ax), acc * _last(corr), p


@triton.jit
def _per_rung(X, r0, nr, other, DT: tl.constexpr, RB: tl.constexpr, COLS: tl.constexpr):
    """``X[r0 + n // COLS]`` per column ``n`` of a block of ``RB`` rungs, ``COLS`` columns each (``other`` past
    the ``nr`` rungs in use), from ``RB`` scalar loads: a per-column gather of the same ``RB`` values cost ~8
    instructions a value and thread."""
    n = tl.arange(0, RB * COLS)
    x = tl.zeros([RB * COLS], DT) + tl.load(X + r0, mask=r0 < nr, other=other).to(DT)
    for j in tl.static_range(1, RB):
        x = tl.where(n // COLS == j, tl.load(X + r0 + j, mask=r0 + j < nr, other=other).to(DT), x)
    return x


@triton.jit
def _rung_keys(kb, vb, FLAGS, bhk, RLO, RWLO, RWHI, r0, nr, i0, T, skt, svt, offs_d, in_d, oc,
               TWO_TAP: tl.constexpr, HAS_DOCS: tl.constexpr, ACC: tl.constexpr, RB: tl.constexpr,
               MC: tl.constexpr, C: tl.constexpr, FWD: tl.constexpr, CHECK: tl.constexpr):
    """Rungs ``[r0, r0 + RB)`` as ``C`` gathered blocks of ``RB·MC`` key rows, one per chunk of ``MC`` tile
    positions (``triton_kernels``' rung chunks): column ``n`` of chunk ``c`` is rung ``r0 + n // MC`` at tile row
    ``c·MC + n % MC``. Returns the first tap's keys and values ``(C, RB·MC, Dh)`` (one chunk: ``(RB·MC, Dh)``), the
    second tap's (two-tap; else the first's again), the taps' weights per column, whether a column exists and
    whether a row it reads is flagged (``(C, RB·MC)``; :func:`_tap`; ``FWD``: the forward).
    Interpolation is applied to scores and probabilities, not to the rows, so that the products take the inputs'
    own rows, exact in half precision. ``HAS_DOCS``: with each column's row's offset in its document (``oc``,
    :func:`_column_offsets`), a key before the document start does not exist, and the second tap is clamped at
    that start."""
    lo = _per_rung(RLO, r0, nr, _NEVER, tl.int32, RB, MC)
    cols = _chunk_cols(i0, MC, C, RB * MC)
    kr = cols - lo
    ok = (kr >= 0) & (kr < T)
    if HAS_DOCS:
        ok = ok & (oc >= lo)
    k1, v1, bad = _tap(kb, vb, FLAGS, bhk, T, kr, skt, svt, offs_d, ok, in_d, FWD, CHECK)
    if TWO_TAP:
        if HAS_DOCS:
            kr2 = kr - (oc > lo).to(tl.int32)
        else:
            kr2 = tl.maximum(kr - 1, 0)
        k2, v2, bad2 = _tap(kb, vb, FLAGS, bhk, T, kr2, skt, svt, offs_d, ok, in_d, FWD, CHECK)
        wlo = _per_rung(RWLO, r0, nr, 1.0, ACC, RB, MC)
        whi = _per_rung(RWHI, r0, nr, 0.0, ACC, RB, MC)
        return k1, v1, k2, v2, wlo, whi, ok, bad | bad2
    else:
        return k1, v1, k1, v1, 1.0, 0.0, ok, bad


@triton.jit
def _column_offsets(OFF, b, T, i0, MC: tl.constexpr, C: tl.constexpr, N: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The document offset of the tile row each of a rung block's columns serves (:func:`_chunk_cols`), for
    :func:`_rung_keys`: the same every step (the query pass reads it once, before its rung loop: 2-3 % fewer
    instructions there with documents; the forward each step: read once, its two-tap kernel took 3 % more)."""
    return _doc_off(OFF, b, T, _chunk_cols(i0, MC, C, N), HAS_DOCS)


@triton.jit
def _tap(kb, vb, FLAGS, bhk, T, kr, skt, svt, offs_d, ok, in_d, FWD: tl.constexpr, CHECK: tl.constexpr):
    """One tap's key and value rows; a flagged value row (``FWD``, the forward) or key row (the query pass)
    comes in as zeros (:func:`_flagged`), and whether it was flagged."""
    bad = _flagged(FLAGS, bhk, T, kr, ok, 2 if FWD else 1, CHECK)
    k = _rows(kb, kr * skt, offs_d, ok if FWD else ok & ~bad, in_d)
    v = _rows(vb, kr * svt, offs_d, ok & ~bad if FWD else ok, in_d)
    return k, v, bad


@triton.jit
def _stored(Q, DO, PR, DSR, DELTA, b, h, i, ok, r, R, T, H, sqb, sqh, sqt, sdb, sdh, sdt, offs_d, in_d,
            CHECK: tl.constexpr):
    """Query rows ``i`` of heads ``h`` (gathered ``q`` and ``dout``), with their stored ``dS`` and ``P``
    of rung ``r``. ``CHECK`` (some row of the heads is unfinished, :func:`_any_unfinished`): an unfinished row
    (its delta is stored as NaN) comes in as zeros, its nonzero ``P`` as NaN."""
    ok = ok & (i < T)
    stat = (b * H + h) * T + i
    slot = stat * R + r
    p = tl.load(PR + slot, mask=ok, other=0.0)
    ds = tl.load(DSR + slot, mask=ok, other=0.0)
    if CHECK:
        delta = tl.load(DELTA + stat, mask=ok, other=0.0)
        off = delta != delta
        ok = ok & ~off
        p = tl.where(off & (p != 0), float("nan"), p)
    qg = _rows(Q + b * sqb, h * sqh + i * sqt, offs_d, ok, in_d)
    dog = _rows(DO + b * sdb, h * sdh + i * sdt, offs_d, ok, in_d)
    return qg, dog, ds, p


@triton.jit
def _doc_off(OFF, b, T, i, HAS_DOCS: tl.constexpr):
    """``off[b, i]``: position ``i``'s offset in its document (0 past ``T``); without documents
    ``i`` itself, read from nowhere."""
    if HAS_DOCS:
        return tl.load(OFF + b * T + i, mask=i < T, other=0)
    else:
        return i


# ----------------------------------------------------------------------------- a program's tile
@triton.jit
def _scale(hi, lo, ACC: tl.constexpr):
    """A scale passed as two float32 numbers (a Python float argument is typed float32): ``hi`` alone for float32
    accumulation, ``hi + lo`` in float64 — the float64 scale to 2**-48 — for float64 inputs."""
    if ACC == tl.float64:
        return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        return hi


@triton.jit
def _program(HKV, ROWS, WIDE: tl.constexpr):
    """This program's batch ``b``, key/value head ``hk`` and first row (``ROWS`` rows a program), as int64 when
    ``WIDE`` (``triton_backend.wide``: an element offset or a row index of some tensor may reach 2**31), so that
    every offset computed from them is; int32 otherwise, where the 64-bit address arithmetic cost the kernels up
    to 16 % of their instructions."""
    b = tl.program_id(1) // HKV
    hk = tl.program_id(1) % HKV
    r0 = tl.program_id(0) * ROWS
    if WIDE:
        return b.to(tl.int64), hk.to(tl.int64), r0.to(tl.int64)
    else:
        return b, hk, r0


@triton.jit
def _tile(T, HKV, GROUP, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, MC: tl.constexpr, WIDE: tl.constexpr):
    """This program's batch ``b``, key/value head ``hk``, first row ``i0`` (:func:`_program`), and per tile row
    ``r``: its position in the tile ``m``, its query head ``h`` and whether it exists. Rows go
    chunk by chunk (the rung chunks: ``r = c·G·MC + g·MC + mc`` is head ``g`` at ``m = c·MC + mc``), so that
    the ``(G·M, ·)`` band blocks reshape to ``(C, G·MC, ·)`` rung blocks as they are."""
    b, hk, i0 = _program(HKV, BLOCK_M, WIDE)
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
