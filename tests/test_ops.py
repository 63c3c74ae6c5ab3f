"""The sparse attention ops: every fast backend against the reference (method.md §1–3).

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``.
"""
import logging

import pytest
import torch

import fibattn
from fibattn.ops import backend_available, backends, columns, cpu_backend, torch_backend
from fibattn.ops.columns import ColumnSpec, host_columns
from fibattn.schedules import attended_distances
from op_helpers import FP32, FP64, alpha_grad_matches_fd, bf16_check, close, interp, make, run, sparse

FAST = ["torch", "cpu"]


# ----------------------------------------------------------------------------- integer op
@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("T", [1, 5, 97])
@pytest.mark.parametrize("W", [0, 6, 12])
@pytest.mark.parametrize("base,alpha", [("fib", 0.5), ("fib", 1.0), ("fib", 1.5), ("pow2", 1.0), ("pow2", 1.5)])
def test_integer_fp32_matches_reference(backend, T, W, base, alpha):
    q, k, v, dout = make(T=T, seed=T + W)
    dists = attended_distances(W, alpha, base, T)
    close(run(sparse(dists, backend), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP32)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("Hkv,base,alpha", [(2, "fib", 1.5), (1, "pow2", 1.0)])
def test_integer_long_sequence(backend, Hkv, base, alpha):
    q, k, v, dout = make(B=1, H=2, Hkv=Hkv, T=1025, Dh=16, seed=Hkv)
    dists = attended_distances(12, alpha, base, 1025)
    close(run(sparse(dists, backend), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP32)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_integer_fp64_grouped_noncontiguous_custom_scale(backend, Hkv):
    q, k, v, dout = make(H=4, Hkv=Hkv, T=61, Dh=5, dtype=torch.float64, noncontig=True, seed=Hkv)
    assert not q.is_contiguous()
    dists = [0, 1, 2, 3, 7, 20, 60, 200]          # 200 >= T is never valid
    got = run(sparse(dists, backend, scale=0.3), q, k, v, dout)
    close(got, run(sparse(dists, "reference", scale=0.3), q, k, v, dout), **FP64)


@pytest.mark.parametrize("backend", FAST)
def test_integer_bf16_within_reference_error(backend):
    q, k, v, dout = make(H=4, Hkv=2, T=97, Dh=16, dtype=torch.float64, seed=3)
    dists = attended_distances(6, 1.5, "fib", 97)
    bf16_check(sparse(dists, backend), sparse(dists, "reference"), q, k, v, dout)


@pytest.mark.parametrize("backend", FAST)
def test_interpolated_bf16_within_reference_error(backend):
    q, k, v, dout = make(H=4, Hkv=2, T=97, Dh=16, dtype=torch.float64, seed=4)
    bf16_check(interp(6, "fib", backend), interp(6, "fib", "reference"), q, k, v, dout, torch.tensor(1.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,Dh,H,Hkv", [(63, 32, 8, 1), (64, 64, 4, 4), (65, 128, 2, 1), (130, 64, 8, 2),
                                        (1025, 32, 2, 2), (97, 96, 4, 2), (66, 48, 2, 1), (70, 256, 2, 1)])
def test_cpu_kernels_at_production_shapes(T, Dh, H, Hkv, dtype):
    """Head sizes of the tiny / paper models and beyond, rows across the kernels' 64-row tiles,
    groups up to 8: both ops, outputs and gradients."""
    q, k, v, dout = make(B=1, H=H, Hkv=Hkv, T=T, Dh=Dh, dtype=dtype, seed=T + Dh)
    exact = [x.double() for x in (q, k, v, dout)]         # the reference in fp64: the truth for fp32 too
    tol = FP64 if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    dists = attended_distances(12, 1.5, "fib", T)
    got = run(sparse(dists, "cpu"), q, k, v, dout)
    close([g.double() for g in got], run(sparse(dists, "reference"), *exact), **tol)
    got = run(interp(12, "fib", "cpu"), q, k, v, dout, torch.tensor(1.37, dtype=dtype))
    want = run(interp(12, "fib", "reference"), *exact, torch.tensor(1.37, dtype=dtype).double())
    close([g.double() for g in got[:4]], want[:4], **tol)
    torch.testing.assert_close(got[4].double(), want[4], rtol=1e-4, atol=1e-4 * want[4].abs().item())


# ----------------------------------------------------------------------------- interpolated op
@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("T", [1, 5, 97])
@pytest.mark.parametrize("W,base,alpha", [(0, "fib", 0.7), (6, "fib", 1.3), (12, "fib", 1.5), (6, "pow2", 1.37),
                                          (12, "pow2", 0.5), (3, [4, 9, 30], 2.2)])
def test_interpolated_matches_reference(backend, T, W, base, alpha):
    q, k, v, dout = make(T=T, dtype=torch.float64, seed=T)
    a = torch.tensor(alpha, dtype=torch.float64)
    close(run(interp(W, base, backend), q, k, v, dout, a), run(interp(W, base, "reference"), q, k, v, dout, a), **FP64)


@pytest.mark.parametrize("backend", FAST)
def test_interpolated_long_fp32_grouped_noncontiguous(backend):
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=1025, Dh=8, noncontig=True, seed=9)
    a = torch.tensor(1.21)
    close(run(interp(12, "fib", backend, scale=0.2), q, k, v, dout, a),
          run(interp(12, "fib", "reference", scale=0.2), q, k, v, dout, a), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", FAST)
def test_alpha_gradient_matches_finite_differences(backend):
    q, k, v, dout = make(T=80, Dh=6, dtype=torch.float64, seed=5)
    alpha_grad_matches_fd(interp(6, "fib", backend), q, k, v, dout)


def test_alpha_gradient_sum_on_the_host_is_the_tensor_sum_and_passes_inf_and_nan():
    """``dalpha`` sums a CPU ``dfrac`` on the host; a diverging step's inf or nan must reach alpha's
    gradient as it would through torch (for the scaler's check), not raise."""
    dfrac, b = torch.tensor([0.25, -1.5, 3.0e-3, 2.0], dtype=torch.float64), (1, 2, 3, 5)
    for dtype in (torch.float32, torch.float64):
        got = columns.dalpha(dfrac, b, torch.tensor(1.5, dtype=dtype))
        want = (dfrac * torch.tensor(b, dtype=torch.float64)).sum().to(dtype)
        assert got.dtype == dtype and got.shape == () and torch.allclose(got, want, rtol=1e-15, atol=0)
    for bad, want in (([float("inf"), -float("inf")], "nan"), ([1e308, 1e308], "inf"), ([float("nan"), 1.0], "nan")):
        got = columns.dalpha(torch.tensor(bad, dtype=torch.float64), (1, 1), torch.tensor(1.0))
        assert str(got.item()) == want
    assert columns.dalpha(torch.zeros(0, dtype=torch.float64), (), torch.tensor(1.0)).item() == 0.0


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("alpha", [1.0, 2.0])
@pytest.mark.parametrize("base", ["fib", "pow2"])
def test_interpolated_equals_integer_for_integer_targets(backend, alpha, base):
    q, k, v, dout = make(T=200, dtype=torch.float64, seed=6)
    got = run(interp(8, base, backend), q, k, v, dout, torch.tensor(alpha, dtype=torch.float64))
    want = run(sparse(attended_distances(8, alpha, base, 200), backend), q, k, v, dout)
    close(got[:4], want, **FP64)


@pytest.mark.parametrize("backend", FAST + ["reference"])
def test_empty_and_short_sequences(backend):
    q, k, v, _ = make(T=0)
    out = fibattn.sparse_attention(q, k, v, [0, 1, 5], backend=backend)
    assert out.shape == q.shape == (2, 4, 0, 8)
    a = torch.tensor(1.2, requires_grad=True)
    out = fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=12, backend=backend)
    assert out.shape == q.shape
    out.sum().backward()
    assert a.grad is not None and a.grad.item() == 0
    q, k, v, dout = make(T=3, dtype=torch.float64)
    got = run(interp(12, "fib", backend), q, k, v, dout, torch.tensor(1.5, dtype=torch.float64))
    close(got, run(interp(12, "fib", "reference"), q, k, v, dout, torch.tensor(1.5, dtype=torch.float64)), **FP64)


def test_reach_caps_interpolated_columns():
    q, k, v, dout = make(T=300, dtype=torch.float64)
    a = torch.tensor(1.1, dtype=torch.float64)
    got = run(interp(6, "fib", "cpu", reach=64), q, k, v, dout, a)
    close(got, run(interp(6, "fib", "reference", reach=64), q, k, v, dout, a), **FP64)


# ----------------------------------------------------------------------------- primitives
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group", [1, 2])
def test_cpu_primitives_match_torch_primitives(dtype, group):
    """Clamp-at-row-0 semantics of scores, wsum and the adjoint wsum_t (unsorted, repeated, >= T)."""
    g = torch.Generator().manual_seed(group)
    B, Hkv, T, D = 2, 2, 33, 7
    dists = [3, 0, 40, 1, 17, 3, 32]
    q = torch.randn(B, Hkv * group, T, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64).to(dtype)
    p = torch.randn(B, Hkv * group, T, len(dists), generator=g, dtype=torch.float64).to(dtype)
    tol = FP64 if dtype == torch.float64 else FP32
    for fn, args in (("scores", (q, k)), ("wsum", (p, k)), ("wsum_t", (p, q))):
        want = getattr(torch_backend, fn)(*args, dists, group)
        got = getattr(cpu_backend, fn)(*args, dists, group)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{fn}: {m}")


def test_column_path_driven_by_cpu_primitives():
    """The torch backend's column path built on the C primitives instead of its own slices."""
    q, k, v, dout = make(T=50, dtype=torch.float64, seed=8)
    for spec, alpha, want_fn in (
            (ColumnSpec(dists=tuple(attended_distances(4, 1.5, "fib", 50))), None,
             sparse(attended_distances(4, 1.5, "fib", 50), "reference", scale=0.4)),
            (ColumnSpec(window=4, base=tuple(fibattn.fib_base(15))), 1.37, interp(4, "fib", "reference", scale=0.4))):
        cols = host_columns(spec, alpha, 50)

        def fn(q, k, v, *a, cols=cols):
            out, P = torch_backend.attn_forward(q.detach(), k.detach(), v.detach(), cols, 0.4, prims=cpu_backend)
            return out, P
        out, P = fn(q, k, v)
        dq, dk, dv, dfrac = torch_backend.attn_backward(q, k, v, out, P, dout, cols, 0.4, need_dfrac=True,
                                                        prims=cpu_backend)
        a = None if alpha is None else torch.tensor(alpha, dtype=torch.float64)
        want = run(want_fn, q, k, v, dout, a)
        close([out, dq, dk, dv], want[:4], **FP64)
        if a is not None:
            got_da = (dfrac * torch.tensor(cols.b, dtype=torch.float64)).sum()
            torch.testing.assert_close(got_da, want[4], **FP64)


# ----------------------------------------------------------------------------- flex (forward only on CPU)
@pytest.mark.skipif(backend_available("flex", torch.device("cpu")) is not None, reason="flex_attention unavailable")
def test_flex_forward_on_cpu():
    q, k, v, _ = make(B=1, H=4, Hkv=2, T=80, Dh=16, seed=10)
    dists = attended_distances(6, 1.5, "fib", 80)
    with torch.no_grad():
        got = fibattn.sparse_attention(q, k, v, dists, scale=0.3, backend="flex")
        want = fibattn.sparse_attention(q, k, v, dists, scale=0.3, backend="reference")
    torch.testing.assert_close(got, want, **FP32)
    with pytest.raises(RuntimeError, match="backward"):
        fibattn.sparse_attention(q.requires_grad_(), k, v, dists, backend="flex")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_cuda_backends_match_reference(backend):
    q, k, v, dout = [x.cuda() for x in make(B=1, H=4, Hkv=2, T=300, Dh=64, seed=11)]
    dists = attended_distances(12, 1.5, "fib", 300)
    close(run(sparse(dists, backend), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP32)


# ----------------------------------------------------------------------------- backend choice
def test_auto_picks_cpu_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(backends, "_auto_logged", set())
    q, k, v, _ = make(T=4)
    with caplog.at_level(logging.INFO, logger="fibattn"):
        fibattn.sparse_attention(q, k, v, [0, 1])
        fibattn.sparse_attention(q, k, v, [0, 1])
    picks = [r.getMessage() for r in caplog.records if "backend auto" in r.getMessage()]
    assert picks == ["fibattn: backend auto -> cpu on cpu"]


def test_cpu_backend_availability_and_cache_dir(monkeypatch, tmp_path):
    assert cpu_backend.unavailable(torch.device("cpu")) is None
    assert "CPU tensors only" in cpu_backend.unavailable(torch.device("meta"))
    monkeypatch.setenv("FIBATTN_CACHE", str(tmp_path))
    assert cpu_backend.cache_dir() == tmp_path
    with pytest.raises(RuntimeError, match="cannot run on meta"):
        fibattn.sparse_attention(*[torch.empty(1, 1, 2, 2, device="meta")] * 3, [0], backend="cpu")


# ----------------------------------------------------------------------------- bad input
def _bad_cases():
    q, k, v, _ = make(T=6)
    return [
        (lambda: fibattn.sparse_attention(q, k[:, :, :5], v[:, :, :5], [0]), "k/v"),
        (lambda: fibattn.sparse_attention(q, k, v[..., :4], [0]), "k and v"),
        (lambda: fibattn.sparse_attention(q[0], k, v, [0]), "q must be a 4-D"),
        (lambda: fibattn.sparse_attention(q.double(), k, v, [0]), "dtype"),
        (lambda: fibattn.sparse_attention(q, k, v.to("meta"), [0]), "device"),
        (lambda: fibattn.sparse_attention(q, k.long(), v, [0]), "k must be a floating-point"),
        (lambda: fibattn.sparse_attention(q[:, :3], k, v, [0]), "divisible by Hkv"),
        (lambda: fibattn.sparse_attention(q, k, v, [1, 2]), "distances must contain 0"),
        (lambda: fibattn.sparse_attention(q, k, v, [0, -1]), "distances must be integers >= 0"),
        (lambda: fibattn.sparse_attention(q, k, v, [0, 1.5]), "distances must be integers"),
        (lambda: fibattn.sparse_attention(q, k, v, [0], backend="cuda"), "backend must be one of"),
        (lambda: fibattn.sparse_attention(q, k, v, [0], scale=0), "scale"),
        (lambda: fibattn.interpolated_sparse_attention(q, k, v, alpha=1.0, base="fib", window=4, backend="flex"),
         "backend 'flex' supports integer distances only"),
        (lambda: fibattn.interpolated_sparse_attention(q, k, v, alpha=1.0, base="fib", window=4, backend="nope"),
         "backend must be one of"),
        (lambda: fibattn.interpolated_sparse_attention(q, k, v, alpha=torch.ones(2), base="fib", window=4), "alpha"),
        (lambda: fibattn.interpolated_sparse_attention(q, k, v, alpha=-1.0, base="fib", window=4), "alpha"),
        (lambda: fibattn.interpolated_sparse_attention(q, k, v, alpha=1.0, base="fib", window=-1), "window"),
        (lambda: fibattn.interpolated_sparse_attention(q, k, v, alpha=1.0, base=[0, 3], window=2), "base"),
        (lambda: fibattn.interpolated_sparse_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], alpha=1.0,
                                                       base="fib", window=-1), "window"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_value_error_naming_the_argument(case):
    call, words = _bad_cases()[case]
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("s", [30.0, 1000.0])
def test_extreme_logits_stay_finite(backend, s):
    """Huge score ranges: the softmax (the C kernels' own float exp included) must not overflow.

    The output is compared with fp64; gradients at such logits are ill-conditioned in fp32
    (for every backend), so for them only finiteness is checked.
    """
    q, k, v, dout = make(B=1, H=2, Hkv=2, T=120, Dh=16, seed=12)
    dists = attended_distances(6, 1.0, "fib", 120)
    want = fibattn.sparse_attention(*(x.double() for x in (q * s, k, v)), dists, backend="reference")
    got = run(sparse(dists, backend), q * s, k, v, dout)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-4, atol=1e-4)
    assert all(torch.isfinite(g).all() for g in got)
