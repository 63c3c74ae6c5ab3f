"""Hypothesis fuzzing of both ops and both host backends against the reference: fp64 and fp32,
head sizes up to 64, groups up to 4, lengths across the C kernels' 64-row tiles."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fibattn
from fibattn.schedules import attended_distances

TOL = {torch.float64: dict(rtol=1e-8, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-5)}

shapes = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 4), st.integers(1, 140),
                   st.one_of(st.integers(1, 9), st.sampled_from([16, 24, 32, 40, 64])))
dtypes = st.sampled_from([torch.float64, torch.float32])
bases = st.one_of(st.integers(1, 10).map(lambda k: f"fib:{k}"), st.just("pow2"),
                  st.lists(st.integers(1, 60), min_size=1, max_size=6))


def _tensors(shape, seed, noncontig, dtype=torch.float64):
    """q, k, v in ``dtype`` (leaves), their float64 copies (the reference's inputs), and dout."""
    B, Hkv, group, T, Dh = shape
    g = torch.Generator().manual_seed(seed)

    def one(h):
        x = torch.randn(B, T, h, Dh, generator=g, dtype=torch.float64).transpose(1, 2) if noncontig else \
            torch.randn(B, h, T, Dh, generator=g, dtype=torch.float64)
        return x.to(dtype)

    fast = [one(Hkv * group).requires_grad_(), one(Hkv).requires_grad_(), one(Hkv).requires_grad_()]
    exact = [x.detach().double().requires_grad_() for x in fast]
    return fast, exact, torch.randn(B, Hkv * group, T, Dh, generator=g, dtype=torch.float64)


def _grads(out, inputs, dout):
    return [out.detach().double()] + [x.double() for x in torch.autograd.grad(out, inputs, dout.to(out.dtype))]


def _check(got, want, dtype):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, want):
        tol = TOL[dtype]
        if name == "dalpha" and dtype == torch.float32:      # one sum over every row and column
            tol = dict(rtol=1e-3, atol=1e-3 * max(1.0, b.abs().item()))
        elif dtype == torch.float32:        # fp32 error scales with the tensor's magnitude, not each (cancelling) entry
            tol = dict(tol, atol=tol["atol"] * max(1.0, b.abs().max().item()))
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name} ({dtype}): {m}")


@settings(max_examples=40, deadline=None)
@given(shape=shapes, window=st.integers(0, 12), alpha=st.floats(0.2, 3.0), base=bases,
       backend=st.sampled_from(["torch", "cpu"]), seed=st.integers(0, 2 ** 16), noncontig=st.booleans(),
       scale=st.none() | st.floats(0.05, 2.0), dtype=dtypes)
def test_integer_op_fuzz(shape, window, alpha, base, backend, seed, noncontig, scale, dtype):
    fast, exact, dout = _tensors(shape, seed, noncontig, dtype)
    dists = attended_distances(window, alpha, base, shape[3])
    want = _grads(fibattn.sparse_attention(*exact, dists, scale=scale, backend="reference"), exact, dout)
    got = _grads(fibattn.sparse_attention(*fast, dists, scale=scale, backend=backend), fast, dout)
    _check(got, want, dtype)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, window=st.integers(0, 12), alpha=st.floats(0.2, 3.0), base=bases,
       backend=st.sampled_from(["torch", "cpu"]), seed=st.integers(0, 2 ** 16), noncontig=st.booleans(),
       reach=st.none() | st.integers(1, 50), dtype=dtypes)
def test_interpolated_op_fuzz(shape, window, alpha, base, backend, seed, noncontig, reach, dtype):
    fast, exact, dout = _tensors(shape, seed, noncontig, dtype)
    a_fast = torch.tensor(alpha, dtype=dtype, requires_grad=True)
    a = a_fast.detach().double().requires_grad_()        # the alpha the fast path sees (fp32 may round it)
    kw = dict(base=base, window=window, reach=reach)
    want = _grads(fibattn.interpolated_sparse_attention(*exact, alpha=a, **kw, backend="reference"), exact + [a], dout)
    got = _grads(fibattn.interpolated_sparse_attention(*fast, alpha=a_fast, **kw, backend=backend), fast + [a_fast],
                 dout)
    _check(got, want, dtype)


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
            _check(got, want, torch.float64)
