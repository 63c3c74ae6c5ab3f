"""Shared by the op tests: inputs, outputs with gradients, and comparisons against the reference.

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``.
"""
import torch

import fibattn

FP32 = dict(rtol=2e-5, atol=2e-5)
FP64 = dict(rtol=1e-9, atol=1e-10)


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


def bf16_check(fn_fast, fn_ref, q, k, v, dout, alpha=None, dtype=torch.bfloat16):
    """Fast bf16 (or ``dtype``) error vs fp64 truth must be within a small multiple of the reference's own.

    ``dalpha`` is one number, so the reference's error on it is luck of rounding; it gets a floor of
    one bf16 ulp of its magnitude.
    """
    lo = [x.to(dtype) for x in (q, k, v, dout)]
    truth = run(fn_ref, q, k, v, dout, alpha)
    ref_err = [(a.double() - b).abs().max().item() for a, b in zip(run(fn_ref, *lo, alpha), truth)]
    got = run(fn_fast, *lo, alpha)
    for name, a, b, e in zip(("out", "dq", "dk", "dv", "dalpha"), got, truth, ref_err):
        if name != "dalpha":
            assert a.dtype == dtype, name
        err = (a.double() - b).abs().max().item()
        if name == "dalpha":
            e = max(e, 2.0 ** -8 * b.abs().item())
        assert err <= 3 * e + 1e-3, f"{name}: bf16 error {err:.3g} > 3 x reference bf16 error {e:.3g}"


def alpha_grad_matches_fd(fn, q, k, v, dout, a0=1.3, h=1e-6):
    """d <fn(q, k, v, alpha), dout> / d alpha: analytic (autograd) against a central difference (fp64)."""
    import pytest

    def loss(a: float) -> float:
        with torch.no_grad():
            return (fn(q, k, v, torch.tensor(a, dtype=torch.float64)) * dout).sum().item()

    numeric = (loss(a0 + h) - loss(a0 - h)) / (2 * h)
    analytic = run(fn, q, k, v, dout, torch.tensor(a0, dtype=torch.float64))[-1].item()
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-7)

