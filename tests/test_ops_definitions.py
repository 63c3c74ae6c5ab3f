"""Every backend against definitions written here from the method's formulas (method.md §1, §3).

Nothing below comes from fibattn: the softmax scale is ``1 / sqrt(Dh)`` written out, the
distance sets and interpolation rungs are worked out by hand in the comments, and the
attention is built row by row. So a wrong default scale, a rounding rule, a cap off by one
or a wrong rung is caught even when the reference backend shares it.
"""
import math

import pytest
import torch

import fibattn
from fibattn.ops import backend_available

BACKENDS = ["reference", "torch", "cpu", pytest.param("triton", marks=pytest.mark.skipif(
    backend_available("triton", torch.device("cpu")) is not None, reason="triton interpreter unavailable"))]


def attention_by_rows(q, k, v, columns_of_row):
    """``softmax(q_i · key / sqrt(Dh)) · value`` per row ``i``; ``columns_of_row(i)`` lists the
    (key, value) pairs of row ``i`` as ``(B, Hkv, Dh)`` tensors; grouped heads share them."""
    B, H, T, Dh = q.shape
    group = H // k.shape[1]
    rows = []
    for i in range(T):
        cols = columns_of_row(i)
        keys = torch.stack([c[0] for c in cols], dim=2).repeat_interleave(group, dim=1)    # (B, H, n, Dh)
        vals = torch.stack([c[1] for c in cols], dim=2).repeat_interleave(group, dim=1)
        scores = (q[:, :, i, None, :] * keys).sum(-1) / math.sqrt(Dh)
        rows.append((torch.softmax(scores, dim=-1)[..., None] * vals).sum(2))
    return torch.stack(rows, dim=2)


def integer_definition(dists):
    def fn(q, k, v):
        return attention_by_rows(q, k, v, lambda i: [(k[:, :, i - d], v[:, :, i - d]) for d in dists if i - d >= 0])
    return fn


def interpolated_definition(window, rungs):
    """``rungs``: ``(lo, b)`` pairs; a rung's column mixes rows ``i - lo`` and ``max(i - lo - 1, 0)``
    with weights ``1 - frac`` and ``frac``, ``frac = alpha * b - lo`` (differentiable in alpha)."""
    def fn(q, k, v, alpha):
        def cols(i):
            out = [(k[:, :, i - d], v[:, :, i - d]) for d in range(window + 1) if i - d >= 0]
            for lo, b in rungs:
                if i - lo >= 0:
                    f = alpha * b - lo
                    j = max(i - lo - 1, 0)
                    out.append(((1 - f) * k[:, :, i - lo] + f * k[:, :, j], (1 - f) * v[:, :, i - lo] + f * v[:, :, j]))
            return out
        return attention_by_rows(q, k, v, cols)
    return fn


def _inputs(T, H=4, Hkv=2, Dh=6, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, T, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64)


def _grads(fn, q, k, v, dout, alpha=None):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if alpha is not None:
        leaves.append(torch.tensor(alpha, dtype=torch.float64, requires_grad=True))
    out = fn(*leaves)
    return [out.detach()] + list(torch.autograd.grad(out, leaves, dout))


def _close(got, want):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- integer distances
# (window, alpha, base, T, reach) -> the set worked out by hand.
SETS = [
    # fib:8 = 1 2 3 5 8 13 21 34; x1.5 = 1.5 3 4.5 7.5 12 19.5 31.5 51; half-to-even: 2 3 4 8 12 20 32 51;
    # above W=3 and <= T-1=39: 4 8 12 20 32 (half-up would give 5, not 4)
    ((3, 1.5, "fib:8", 40, None), [0, 1, 2, 3, 4, 8, 12, 20, 32]),
    # x1.0 with reach 21: cap 20 keeps 5 8 13 and drops 21
    ((3, 1.0, "fib:8", 40, 21), [0, 1, 2, 3, 5, 8, 13]),
    # reach 22: cap 21 keeps 21
    ((3, 1.0, "fib:8", 40, 22), [0, 1, 2, 3, 5, 8, 13, 21]),
    # pow2 up to T-1 = 24: 1 2 4 8 16; x0.75 = .75 1.5 3 6 12 -> 1 2 3 6 12; above W=2: 3 6 12
    ((2, 0.75, "pow2", 25, None), [0, 1, 2, 3, 6, 12]),
    # W = 0: fib:6 x2.5 = 2.5 5 7.5 12.5 20 32.5 -> 2 5 8 12 20 32; <= 29: 2 5 8 12 20
    ((0, 2.5, "fib:6", 30, None), [0, 2, 5, 8, 12, 20]),
]


@pytest.mark.parametrize("case", SETS, ids=lambda c: f"W{c[0][0]}-a{c[0][1]}-{c[0][2]}-T{c[0][3]}-r{c[0][4]}")
def test_distance_sets_worked_by_hand(case):
    (window, alpha, base, T, reach), want = case
    assert fibattn.attended_distances(window, alpha, base, T, reach=reach) == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SETS[:2] + SETS[3:], ids=lambda c: f"W{c[0][0]}-T{c[0][3]}-r{c[0][4]}")
def test_integer_op_matches_definition(backend, case):
    (window, alpha, base, T, reach), dists = case
    q, k, v, dout = _inputs(T, seed=T)
    got = _grads(lambda q, k, v: fibattn.sparse_attention(
        q, k, v, fibattn.attended_distances(window, alpha, base, T, reach=reach), backend=backend), q, k, v, dout)
    _close(got, _grads(integer_definition(dists), q, k, v, dout))


# ----------------------------------------------------------------------------- interpolated
# (window, alpha, base, T, reach) -> used rungs (lo, b) worked out by hand.
RUNGS = [
    # fib:7 = 1 2 3 5 8 13 21; x1.3 = 1.3 2.6 3.9 6.5 10.4 16.9 27.3: lo 1 and 2 are window distances (W=2),
    # then 3 6 10 16 27 (all <= T-1 = 29)
    ((2, 1.3, "fib:7", 30, None), [(3, 3), (6, 5), (10, 8), (16, 13), (27, 21)]),
    # the same with reach 27: cap 26 drops lo 27
    ((2, 1.3, "fib:7", 40, 27), [(3, 3), (6, 5), (10, 8), (16, 13)]),
    # x0.55 over 9 2 1 5 41 40 300 = 4.95 1.1 .55 2.75 22.55 22.0 165: lo 4, (1: window), (0: window), 2,
    # 22, (22 again: dropped), (165 > cap 29 = reach - 1: dropped); in base order
    ((1, 0.55, [9, 2, 1, 5, 41, 40, 300], 50, 30), [(4, 9), (2, 5), (22, 41)]),
    # an integer target: x2.0 over fib:5 = 2 4 6 10 16 with W=3: rungs 4 6 10 16 at frac 0
    ((3, 2.0, "fib:5", 20, None), [(4, 2), (6, 3), (10, 5), (16, 8)]),
]


@pytest.mark.parametrize("case", RUNGS, ids=lambda c: f"W{c[0][0]}-a{c[0][1]}-T{c[0][3]}-r{c[0][4]}")
def test_interpolation_rungs_worked_by_hand(case):
    (window, alpha, base, T, reach), rungs = case
    plan = fibattn.interpolation_plan(window, alpha, base, T, reach=reach)
    assert plan.window == tuple(range(window + 1)) and list(plan.rungs) == rungs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", RUNGS, ids=lambda c: f"W{c[0][0]}-a{c[0][1]}-T{c[0][3]}-r{c[0][4]}")
def test_interpolated_op_matches_definition(backend, case):
    (window, alpha, base, T, reach), rungs = case
    q, k, v, dout = _inputs(T, seed=T + 1)
    got = _grads(lambda q, k, v, a: fibattn.interpolated_sparse_attention(
        q, k, v, alpha=a, base=base, window=window, reach=reach, backend=backend), q, k, v, dout, alpha)
    _close(got, _grads(interpolated_definition(window, rungs), q, k, v, dout, alpha))


# ----------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
def test_gradcheck_fp64(backend):
    """Finite differences of the ops themselves, for q, k, v and alpha (small shapes, fp64)."""
    q, k, v, _ = _inputs(9, H=2, Hkv=1, Dh=3, B=1, seed=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    a = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: fibattn.sparse_attention(q, k, v, [0, 1, 3, 5], backend=backend), (q, k, v))
    assert torch.autograd.gradcheck(       # fast mode: a random projection of the Jacobian, alpha's column included
        lambda q, k, v, a: fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib:6", window=1,
                                                                 backend=backend), (q, k, v, a), fast_mode=True)
