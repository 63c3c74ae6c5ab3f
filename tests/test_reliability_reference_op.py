"""The op's ``reference`` backend stays a definition (split from ``test_reliability_data.py``):
distances ``>= T`` cost nothing, and every dtype the other backends accept is computed with one
rounding, at the end."""
import time

import pytest
import torch

import fibattn


def test_reference_drops_distances_beyond_t_before_allocating():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    want = fibattn.sparse_attention(q, k, v, [0, 1, 3], backend="reference")
    for far in (2 * 10 ** 9, 10 ** 13, 10 ** 30):
        t0 = time.perf_counter()
        got = fibattn.sparse_attention(q, k, v, [0, 1, 3, far], backend="reference")
        assert time.perf_counter() - t0 < 1.0
        assert torch.equal(got, want)
        torch.testing.assert_close(fibattn.sparse_attention(q, k, v, [0, 1, 3, far] if far < 2 ** 62 else [0, 1, 3],
                                                            backend="torch"), got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["integer", "interpolated"])
def test_reference_is_a_definition_in_every_dtype(dtype, op):
    """Output and gradients in the input dtype, and the output within one rounding of the exact
    (fp64) result on the same rounded inputs; the fast backends agree with it."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]

    def fn(backend):
        if op == "integer":
            return lambda a, b, c: fibattn.sparse_attention(a, b, c, [0, 1, 2, 5, 13, 34, 10 ** 6], backend=backend)
        return lambda a, b, c: fibattn.interpolated_sparse_attention(a, b, c, alpha=1.3, base="fib", window=3,
                                                                     backend=backend)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn("reference")(*leaves)
    out.sum().backward()
    assert out.dtype == dtype and all(x.grad.dtype == dtype and torch.isfinite(x.grad).all() for x in leaves)
    truth = fn("reference")(*(x.double() for x in (q, k, v)))
    ref = torch.maximum(truth.abs(), 0.1 * truth.abs().max())          # as op_helpers.ulps measures
    ulp = torch.exp2(torch.floor(torch.log2(ref))) * torch.finfo(dtype).eps
    err = ((out.double() - truth).abs() / ulp).max().item()
    assert err <= (0.51 if dtype in (torch.float16, torch.bfloat16) else 16), err     # one rounding, at the end
    for backend in ("torch", "cpu"):
        fast = fn(backend)(q, k, v)
        tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
        torch.testing.assert_close(fast.double(), out.double(), rtol=tol, atol=tol)
