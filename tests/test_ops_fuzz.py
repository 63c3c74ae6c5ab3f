"""Hypothesis fuzzing of both ops and both fast backends against the reference (fp64, small sizes)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fibattn
from fibattn.schedules import attended_distances

TOL = dict(rtol=1e-8, atol=1e-9)

shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 2), st.integers(1, 40), st.integers(1, 9))
bases = st.one_of(st.integers(1, 10).map(lambda k: f"fib:{k}"), st.just("pow2"),
                  st.lists(st.integers(1, 60), min_size=1, max_size=6))


def _tensors(shape, seed, noncontig):
    B, Hkv, group, T, Dh = shape
    g = torch.Generator().manual_seed(seed)

    def one(h):
        if noncontig:
            return torch.randn(B, T, h, Dh, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
        return torch.randn(B, h, T, Dh, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = one(Hkv * group), one(Hkv), one(Hkv)
    return q, k, v, torch.randn(B, Hkv * group, T, Dh, generator=g, dtype=torch.float64)


def _grads(out, inputs, dout):
    return [out.detach()] + list(torch.autograd.grad(out, inputs, dout))


def _check(got, want):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


@settings(max_examples=40, deadline=None)
@given(shape=shapes, window=st.integers(0, 12), alpha=st.floats(0.2, 3.0), base=bases,
       backend=st.sampled_from(["torch", "cpu"]), seed=st.integers(0, 2 ** 16), noncontig=st.booleans(),
       scale=st.none() | st.floats(0.05, 2.0))
def test_integer_op_fuzz(shape, window, alpha, base, backend, seed, noncontig, scale):
    q, k, v, dout = _tensors(shape, seed, noncontig)
    dists = attended_distances(window, alpha, base, shape[3])
    want = _grads(fibattn.sparse_attention(q, k, v, dists, scale=scale, backend="reference"), (q, k, v), dout)
    got = _grads(fibattn.sparse_attention(q, k, v, dists, scale=scale, backend=backend), (q, k, v), dout)
    _check(got, want)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, window=st.integers(0, 12), alpha=st.floats(0.2, 3.0), base=bases,
       backend=st.sampled_from(["torch", "cpu"]), seed=st.integers(0, 2 ** 16), noncontig=st.booleans(),
       reach=st.none() | st.integers(1, 50))
def test_interpolated_op_fuzz(shape, window, alpha, base, backend, seed, noncontig, reach):
    q, k, v, dout = _tensors(shape, seed, noncontig)
    a = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
    kw = dict(alpha=a, base=base, window=window, reach=reach)
    want = _grads(fibattn.interpolated_sparse_attention(q, k, v, **kw, backend="reference"), (q, k, v, a), dout)
    got = _grads(fibattn.interpolated_sparse_attention(q, k, v, **kw, backend=backend), (q, k, v, a), dout)
    _check(got, want)


def test_unsorted_custom_base():
    """Found by fuzzing: a custom base out of order gives rungs out of order."""
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 30, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    dout = torch.randn(1, 2, 30, 3, generator=g, dtype=torch.float64)
    for alpha in (1.0, 1.3):
        a = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
        kw = dict(alpha=a, base=[9, 2, 1, 5], window=0)
        want = _grads(fibattn.interpolated_sparse_attention(q, k, v, **kw, backend="reference"), (q, k, v, a), dout)
        for backend in ("torch", "cpu"):
            got = _grads(fibattn.interpolated_sparse_attention(q, k, v, **kw, backend=backend), (q, k, v, a), dout)
            _check(got, want)
