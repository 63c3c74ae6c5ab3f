"""Packed documents in the ``cpu`` kernel set: a packed row equals its documents run alone (issue 25).

The kernels take ``off`` ``(B, T)`` int32, each row's position inside its document; the
columns of the packed call are resolved at the packed length, those of each separate call at
the document's own length (columns with ``lo >= L`` are never valid in a document of length L).
"""
import pytest
import torch

from fibattn.ops import cpu_backend
from fibattn.ops.columns import ColumnSpec, host_columns
from fibattn.schedules import as_base, attended_distances

from op_helpers import FP32, FP64, close, make

pytestmark = pytest.mark.skipif(cpu_backend.unavailable("cpu") is not None, reason="cpu kernels unavailable")

BASE = "fib:6"              # largest rung ~ 13 * alpha: the 70-row documents outlast every distance
SCALE = 0.4
SPLITS = [[1, 2, 5, 70, 3, 69],         # lengths 1 and 2, odd lengths, documents across 64-row blocks
          [150],                         # one document
          [7, 1, 9, 2, 60, 71]]


def positions(splits) -> torch.Tensor:
    """``off`` for rows split into documents of the given lengths."""
    return torch.tensor([[i for n in row for i in range(n)] for row in splits], dtype=torch.int32)


def spec_for(W: int, alpha):
    """(spec, alpha): integer distances when ``alpha`` is None, else the interpolated op's columns."""
    if alpha is None:
        return ColumnSpec(tuple(attended_distances(W, 1.5, BASE, sum(SPLITS[0])))), None
    return ColumnSpec(None, W, tuple(as_base(BASE).resolve(0)), None), alpha


def fwd_bwd(q, k, v, dout, spec, alpha, off=None):
    """``(out, dq, dk, dv, dalpha)`` of the fused kernels; dalpha is None for integer distances."""
    cols = host_columns(spec, alpha, q.shape[2])
    out, P = cpu_backend.attn_forward(q, k, v, cols, SCALE, off=off)
    dq, dk, dv, dfrac = cpu_backend.attn_backward(q, k, v, out, P, dout, cols, SCALE,
                                                  need_dfrac=alpha is not None, off=off)
    da = None if dfrac is None else (dfrac * torch.tensor(cols.b, dtype=torch.float64)).sum()
    return out, dq, dk, dv, da


def through_interface(q, k, v, dout, spec, alpha, off=None):
    """The same through the kernel set's op interface (half-precision inputs computed in fp32)."""
    a = None if alpha is None else torch.tensor(alpha, dtype=torch.float64)
    out, P = cpu_backend.forward(q, k, v, spec, a, SCALE, off=off)
    return (out, *cpu_backend.backward(dout, q, k, v, out, P, spec, a, SCALE, a is not None, off=off))


def separately(q, k, v, dout, spec, alpha, splits, run=fwd_bwd):
    """Each document through ``run`` on its own (no ``off``), concatenated along T."""
    want = [torch.empty_like(x) for x in (q, q, k, v)]
    da = torch.zeros((), dtype=torch.float64)
    for b, row in enumerate(splits):
        s = 0
        for n in row:
            part = run(*(x[b:b + 1, :, s:s + n] for x in (q, k, v, dout)), spec, alpha)
            for w, got in zip(want, part):
                w[b:b + 1, :, s:s + n] = got
            if alpha is not None:
                da += part[4]
            s += n
    return (*want, da if alpha is not None else None)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.float64, FP64)])
@pytest.mark.parametrize("alpha", [None, 1.37, 1.0])
@pytest.mark.parametrize("W", [0, 5])
@pytest.mark.parametrize("Dh", [12, 64])
def test_packed_rows_equal_separate_documents(W, alpha, dtype, tol, Dh):
    """Dh 12 runs the generic rows, 64 the vector rows (whose taps clamp at a document's start on their own
    path: a rung whose first tap is a document's first row reads its second tap there too)."""
    q, k, v, dout = make(B=len(SPLITS), H=4, Hkv=2, T=sum(SPLITS[0]), Dh=Dh, dtype=dtype, seed=W)
    spec, alpha = spec_for(W, alpha)
    got = fwd_bwd(q, k, v, dout, spec, alpha, positions(SPLITS))
    close(got, separately(q, k, v, dout, spec, alpha, SPLITS), **tol)


@pytest.mark.parametrize("alpha", [None, 1.37])
def test_packed_rows_equal_separate_documents_bf16(alpha):
    q, k, v, dout = (x.to(torch.bfloat16) for x in make(B=len(SPLITS), H=4, Hkv=2, T=sum(SPLITS[0]), Dh=12))
    spec, alpha = spec_for(5, alpha)
    got = through_interface(q, k, v, dout, spec, alpha, positions(SPLITS))
    close(got, separately(q, k, v, dout, spec, alpha, SPLITS, run=through_interface))     # bf16's default tolerance


@pytest.mark.parametrize("alpha", [None, 1.37])
def test_one_document_is_the_plain_op_bit_for_bit(alpha, one_thread):
    q, k, v, dout = make(B=2, H=4, Hkv=2, T=150, Dh=12, dtype=torch.float64)
    spec, alpha = spec_for(3, alpha)
    got = fwd_bwd(q, k, v, dout, spec, alpha, positions([[150], [150]]))
    for a, b in zip(got, fwd_bwd(q, k, v, dout, spec, alpha)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_off_is_checked_for_type_and_shape():
    q, k, v, _ = make(B=2, H=2, Hkv=2, T=8, Dh=4)
    cols = host_columns(ColumnSpec((0, 1, 2)), None, 8)
    for off in (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int32)):
        with pytest.raises(ValueError, match="off must be"):
            cpu_backend.attn_forward(q, k, v, cols, SCALE, off=off)
