"""Triton kernels of the ``triton`` backend: a tensor-core window band plus rung tiles.

Imported only by :mod:`fibattn.ops.triton_backend`, after ``TRITON_INTERPRET`` is settled
(Triton reads it when a kernel is defined). The forward kernel is in :mod:`fibattn.ops.triton_forward`, the
backward's in :mod:`fibattn.ops.triton_backward`, their tile-level pieces in :mod:`fibattn.ops.triton_tiles`.

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

from .triton_backward import bwd_dkdv_kernel, bwd_dq_kernel
from .triton_forward import fwd_kernel
from .triton_tiles import _NEVER, NEVER, _head_flags, _program, _rows

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
                 BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    """``FLAGS[b, hk, t]`` (int32, ``T + 2`` a head: ``_head_flags``): bit 0 when key row ``(b, hk, t)`` holds a
    NaN or inf, bit 1 when its value row does (``_flagged``), and at ``t = T`` the OR of the head's rows: one read of
    K and V, so that the attention kernels test a flag per row, not each element, a non-finite value reaches only
    the queries that attend it, and a head without one is read without any test (``_any_flagged``)."""
    b, hk, t0 = _program(HKV, BLOCK_R, WIDE)
    t = t0 + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = t < T
    k = _rows(K + b * skb + hk * skh, t * skt, offs_d, ok, offs_d < DH)
    v = _rows(V + b * svb + hk * svh, t * svt, offs_d, ok, offs_d < DH)
    kbad = tl.max(tl.where(tl.abs(k.to(tl.float32)) < float("inf"), 0, 1), axis=1)
    vbad = tl.max(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 0, 2), axis=1)
    flags = _head_flags(FLAGS, b * HKV + hk, T)
    tl.store(flags + t, kbad | vbad, mask=ok)
    # the head's summary (after its T rows, zeroed by the host): an OR, the same whichever program comes first
    head = tl.max(kbad | vbad, axis=0)
    tl.atomic_or(flags + T, head, mask=head != 0)
