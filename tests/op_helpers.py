"""Shared by the op tests: inputs, outputs with gradients, and comparisons against the reference.

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``.
"""
import contextlib
import dataclasses

import torch

import fibattn
from fibattn.ops import cpu_backend
from fibattn.ops.columns import Columns
from fibattn.ops.documents import offsets_unchecked
from fibattn.schedules import attended_distances

FP32 = dict(rtol=2e-5, atol=2e-5)
FP64 = dict(rtol=1e-9, atol=1e-10)
CPU_TOL = dict(rtol=1e-4, atol=1e-5)        # the cpu kernels in fp32 against the fp64 reference


def make(B=2, H=4, Hkv=2, T=97, Dh=8, dtype=torch.float32, seed=0, noncontig=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def one(h):
        if noncontig:      # (B, T, h, Dh) viewed as (B, h, T, Dh)
            return torch.randn(B, T, h, Dh, generator=g, dtype=torch.float64).to(device, dtype).transpose(1, 2)
        return torch.randn(B, h, T, Dh, generator=g, dtype=torch.float64).to(device, dtype)

    q, k, v = one(H), one(Hkv), one(Hkv)
    dout = torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64).to(device, dtype)
    return q, k, v, dout


def run(fn, q, k, v, dout, alpha=None):
    """Output and gradients of q, k, v (and alpha when it is a tensor)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.detach().clone().requires_grad_(True)
        out = fn(*leaves, alpha)
        grads = torch.autograd.grad(out, leaves + [alpha], dout)
    else:
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
    return [out.detach()] + list(grads)


def close(got, want, **tol):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, want):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}", **tol)


def sparse(dists, backend, scale=None):
    return lambda q, k, v: fibattn.sparse_attention(q, k, v, dists, scale=scale, backend=backend)


def interp(window, base, backend, scale=None, reach=None):
    return lambda q, k, v, a: fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base=base, window=window,
                                                                    reach=reach, scale=scale, backend=backend)


def ulps(got, truth, dtype) -> float:
    """Largest error of ``got`` in units of ``dtype``'s last place at each element of ``truth``
    (elements below a tenth of the largest are measured at that tenth, so that near-zero
    entries do not dominate)."""
    truth, got = truth.double(), got.double()
    ref = torch.maximum(truth.abs(), 0.1 * truth.abs().max()).clamp_min(1e-300)
    ulp = torch.exp2(torch.floor(torch.log2(ref))) * torch.finfo(dtype).eps
    return ((got - truth).abs() / ulp).max().item()


def bf16_check(fn_fast, fn_ref, q, k, v, dout, alpha=None, dtype=torch.bfloat16):
    """A fast path on half-precision inputs against exact (fp64) maths on the same rounded inputs.

    A path that accumulates in fp32 and rounds once at the end is within one unit in the last
    place on ``out`` and ``dv`` (rounding to nearest: 0.5; Triton's interpreter truncates: 1.0);
    one that accumulates in half precision is several units off (measured: 7–9). ``dq`` and
    ``dk`` go through ``p * (dp - delta)``, whose cancellation amplifies the rounding of the
    saved half-precision ``out``; they get a wider bound, ``d alpha`` a relative one.
    """
    lo = [x.to(dtype) for x in (q, k, v, dout)]
    a64 = None if alpha is None else alpha.double()
    truth = run(fn_ref, *(x.double() for x in lo), a64)
    got = run(fn_fast, *lo, alpha)
    bounds = {"out": 1.5, "dq": 12, "dk": 12, "dv": 1.5}
    for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, truth):
        if name == "dalpha":
            rel = abs(a.item() - b.item()) / max(abs(b.item()), 1e-12)
            assert rel <= 2 ** -6, f"dalpha: relative error {rel:.3g} > 2^-6"
            continue
        assert a.dtype == dtype, name
        err = ulps(a, b, dtype)
        assert err <= bounds[name], f"{name}: {err:.2f} units in the last place > {bounds[name]}"


def alpha_grad_matches_fd(fn, q, k, v, dout, a0=1.3, h=1e-6):
    """d <fn(q, k, v, alpha), dout> / d alpha: analytic (autograd) against a central difference (fp64)."""
    import pytest

    def loss(a: float) -> float:
        with torch.no_grad():
            return (fn(q, k, v, torch.tensor(a, dtype=torch.float64)) * dout).sum().item()

    numeric = (loss(a0 + h) - loss(a0 - h)) / (2 * h)
    analytic = run(fn, q, k, v, dout, torch.tensor(a0, dtype=torch.float64))[-1].item()
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-7)



def doc_ids(B: int, T: int, lengths) -> torch.Tensor:
    """document_ids cutting each row into documents of the given lengths (the last one takes the rest)."""
    ids, doc, left = [], 0, list(lengths)
    while len(ids) < T:
        n = left.pop(0) if left else T
        ids += [doc] * min(n, T - len(ids))
        doc += 1
    return torch.tensor([ids] * B)


def cpu_matches_reference(q, k, v, dout, W, alpha, docs):
    """The cpu kernels' integer and interpolated (alpha ``alpha``) Fibonacci columns with window ``W``
    and document_ids ``docs``: outputs and gradients against the fp64 reference."""
    exact = [x.double() for x in (q, k, v, dout)]
    dists = attended_distances(W, 1.5, "fib", q.shape[2])

    def integer(backend):
        return lambda q, k, v: fibattn.sparse_attention(q, k, v, dists, backend=backend, document_ids=docs)

    def frac(backend):
        return lambda q, k, v, a: fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=W,
                                                                        backend=backend, document_ids=docs)
    a = torch.tensor(alpha)
    close([g.double() for g in run(integer("cpu"), q, k, v, dout)], run(integer("reference"), *exact), **CPU_TOL)
    got, want = run(frac("cpu"), q, k, v, dout, a), run(frac("reference"), *exact, a.double())
    close([g.double() for g in got[:4]], want[:4], **CPU_TOL)
    torch.testing.assert_close(got[4].double(), want[4], rtol=1e-4, atol=1e-4 * max(want[4].abs().item(), 1.0))


@contextlib.contextmanager
def cpu_rows(kind):
    """The cpu kernel set's rows inside the block: ``"vector"`` (its own choice by head size) or
    ``"generic"`` on every head size (the backend's test hook); restored afterwards."""
    assert kind in ("vector", "generic"), kind
    before, cpu_backend._generic_rows = cpu_backend._generic_rows, kind == "generic"
    try:
        yield
    finally:
        cpu_backend._generic_rows = before


def cpu_kernels(q, k, v, dout, cols, kind, threads, off=None):
    """The cpu kernel set's ``(out, dq, dk, dv, dfrac)`` over ``cols`` (scale 0.3), with its rows of
    ``kind`` (:func:`cpu_rows`) on ``threads`` threads; both settings are restored afterwards."""
    nt = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with cpu_rows(kind):
            out, P = cpu_backend.attn_forward(q, k, v, cols, 0.3, off=off)
            return (out, *cpu_backend.attn_backward(q, k, v, out, P, dout, cols, 0.3, need_dfrac=True, off=off))
    finally:
        torch.set_num_threads(nt)


# (single-tap columns, two-tap columns after them, single-tap ones after those) for the cpu kernels' dot lanes
TWO_TAP_SPLITS = [
    (13, 10, 0),     # the bench's columns: 33 dot lanes, the last group's one lane (of 8 or 16) a dot
    (13, 4, 0),      # 21 lanes: the last group's 5 dotted whole (of 8) or as five dots (of 16)
    (5, 4, 3),       # 16 lanes; single-tap columns after the two-tap ones
    (6, 2, 0),       # 10 lanes: the last group's 2 (of 8) as two dots
    (9, 7, 1),       # 24 lanes: the last group's 8 whole (of 8) or as eight dots (of 16)
    (2, 1, 0),       # one two-tap column, 4 lanes
    (4, -3, 2),      # two-tap columns apart (-3: every other one of 3): the generic rows
]


def two_tap_layout_matches_generic_rows(before, two, after, dtype):
    """Columns split as in TWO_TAP_SPLITS, rows clamped at a document start, the alpha gradient from saved
    slopes and from the backward's own dots: the vector rows' results are the generic rows'. Then again
    with every other two-tap column, the last one first, at frac 0 (an integer alpha * b): the vector rows'
    weighted sums skip those second taps, the generic rows weigh them by 0."""
    q, k, v, dout = (x.to(dtype) for x in make(B=1, H=2, Hkv=1, T=120, Dh=32, seed=before + 7 * abs(two)))
    kinds = [False] * before + ([True] * two if two > 0 else [True, False] * -two) + [False] * after
    lo = tuple(range(before)) + tuple(before + 3 * j for j in range(len(kinds) - before))
    frac = [0.25 + 0.5 * j / len(kinds) if t else 0.0 for j, t in enumerate(kinds)]
    whole = [j for j, t in enumerate(kinds) if t][::-2]
    off = offsets_unchecked(doc_ids(1, 120, (30, 1, 50)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for fr in (frac, [0.0 if j in whole else f for j, f in enumerate(frac)]):
        cols = Columns(lo, tuple(1 - f for f in fr), tuple(fr), tuple(kinds), tuple(int(t) for t in kinds), True)
        for c in (cols, dataclasses.replace(cols, interpolated=False)):     # False: no slopes saved
            close(cpu_kernels(q, k, v, dout, c, "vector", 2, off), cpu_kernels(q, k, v, dout, c, "generic", 2, off),
                  **tol)


def poison_scratch():
    """Fill the cpu backward's dS scratch with NaN, so that a dS read before it is written shows."""
    for buf in cpu_backend._scratch.bufs.values():
        buf.fill_(float("nan"))


def use_kernel_build(patch, cache, flags):
    """Switch the cpu backend to a library built with ``flags`` (instead of the backend's own) into the
    folder ``cache``, through ``patch`` (a MonkeyPatch: undoing it restores the usual library)."""
    patch.setenv("FIBATTN_CACHE", str(cache))
    patch.setattr(cpu_backend, "_CFLAGS", tuple(flags))
    patch.setattr(cpu_backend, "_state", None)
    assert cpu_backend.unavailable("cpu") is None
    return cpu_backend._build().lib
