"""The ``triton`` kernels with documents (issue 25): a packed row equals its documents run one by one.

The kernel set is called directly with ``off`` (each position's offset in its document); the
public ops' ``document_ids`` are tested with every backend elsewhere. Without a GPU the kernels
run in Triton's interpreter (``conftest.py``); ``-m gpu`` runs the same cases on CUDA.
"""
import pytest
import torch

import test_ops_triton
from fibattn.ops import triton_backend
from fibattn.ops.columns import ColumnSpec
from fibattn.schedules import fib_base

from op_helpers import FP32, make

device = test_ops_triton.device     # the fixture: the interpreter, or CUDA under -m gpu
FIB = tuple(fib_base(15))           # 'fib': its values do not depend on T


def offsets(splits, device) -> torch.Tensor:
    """``off`` ``(B, T)`` int32 from each row's document lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in splits]).to(device, torch.int32)


def kernels(q, k, v, dout, spec, alpha, off=None):
    """Output and gradients (q, k, v, and alpha for the interpolated op) straight from the kernel set."""
    scale = q.shape[-1] ** -0.5
    out, lse = triton_backend.forward(q, k, v, spec, alpha, scale, off=off)
    grads = triton_backend.backward(dout, q, k, v, out, lse, spec, alpha, scale, spec.interpolated, off=off)
    return [out, *grads[:3]] + ([grads[3]] if spec.interpolated else [])


def separately(q, k, v, dout, spec, alpha, splits):
    """Each document of each row on its own (no ``off``), concatenated along T; d alpha summed."""
    rows, da = [], 0.0
    for b, row in enumerate(splits):
        parts, s = [], 0
        for n in row:
            parts.append(kernels(*(x[b:b + 1, :, s:s + n] for x in (q, k, v, dout)), spec, alpha))
            s += n
        rows.append([torch.cat(p, dim=2) for p in zip(*(part[:4] for part in parts))])
        if spec.interpolated:
            da = da + sum(part[4] for part in parts)
    return [torch.cat(x, dim=0) for x in zip(*rows)] + ([da] if spec.interpolated else [])


def check(q, k, v, dout, spec, alpha, splits, **tol):
    got = kernels(q, k, v, dout, spec, alpha, offsets(splits, q.device))
    want = separately(q, k, v, dout, spec, alpha, splits)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, want):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}", **tol)


# rows of T = 37: documents of 1 and 2, odd lengths, one document, documents that start on a
# 16-row tile's first row (16, 32) and one past it; 29 and 33 are longer than the largest integer distance
SPLITS = [[1, 2, 5, 29], [16, 1, 15, 5], [37], [2, 1, 1, 33]]
# a group of two; the second program of a row; a group of four
SHAPES = {"g2": dict(H=2, Hkv=1), "g2-hkv2": dict(H=4, Hkv=2), "g4": dict(H=4, Hkv=1)}


@pytest.mark.parametrize("dists,shape,rows", [
    pytest.param((0, 2, 3, 5, 8, 13, 21), "g2", SPLITS[:2], id="W0"),
    pytest.param((0, 1, 2, 3, 5, 8, 13, 21), "g2-hkv2", SPLITS[2:], id="W3", marks=pytest.mark.slow),
])
def test_integer_packed_equals_separate(device, dists, shape, rows):
    q, k, v, dout = make(B=len(rows), T=37, Dh=16, seed=1, device=device, **SHAPES[shape])
    check(q, k, v, dout, ColumnSpec(dists), None, rows, **FP32)


@pytest.mark.parametrize("window,alpha,shape,rows", [
    pytest.param(0, 1.37, "g2", SPLITS[:2], id="W0"),
    pytest.param(3, 1.37, "g2-hkv2", SPLITS[2:], id="W3", marks=pytest.mark.slow),    # the interpreter: ~10 s
    pytest.param(2, 2.0, "g2", SPLITS[1:3], id="W2-integer-alpha"),
    pytest.param(1, 1.37, "g4", [SPLITS[0]], id="W1-g4-small-steps"),
])
def test_interpolated_packed_equals_separate(device, window, alpha, shape, rows, monkeypatch):
    """Two-tap rungs (lo 1, 2, 4, 6, 10, 17, 28 at 1.37): a query at offset ``lo`` in its document
    reads its first tap twice; d alpha of the packed call is the sum of the documents'. The group of four takes
    the tile choices' other candidates (``triton_config.config``): the rungs in one chunk at one rung a step in
    the forward and query pass, one in the key pass (its blocks placed by selects), a band step of 16 keys in the
    forward."""
    if shape == "g4":
        monkeypatch.setenv("FIBATTN_TRITON_RUNG_CHUNK", "16")
        monkeypatch.setenv("FIBATTN_TRITON_RUNG_STEP", "1")
        monkeypatch.setenv("FIBATTN_TRITON_BLOCK_N_TWO_TAP_DOCS", "16")
        monkeypatch.setenv("FIBATTN_TRITON_RB_KEY_PASS", "1")
        monkeypatch.setenv("FIBATTN_TRITON_KEY_PASS_PRODUCTS", "0")
    q, k, v, dout = make(B=len(rows), T=37, Dh=16, seed=2, device=device, **SHAPES[shape])
    check(q, k, v, dout, ColumnSpec(None, window, FIB), torch.tensor(alpha, device=device), rows,
          rtol=1e-4, atol=1e-4)


def test_bf16_packed_equals_separate(device):
    q, k, v, dout = (x.to(torch.bfloat16) for x in make(B=1, H=2, Hkv=1, T=37, Dh=16, seed=3, device=device))
    check(q, k, v, dout, ColumnSpec((0, 1, 2, 5, 8, 13)), None, SPLITS[:1])
    check(q, k, v, dout, ColumnSpec(None, 2, FIB), torch.tensor(1.37, device=device), SPLITS[1:2],
          rtol=2e-2, atol=2e-2)


def test_single_row_of_one(device):
    """T = 1: one document of one token, with and without ``off``."""
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=1, Dh=8, seed=6, device=device)
    check(q, k, v, dout, ColumnSpec(None, 2, FIB), torch.tensor(1.37, device=device), [[1]], **FP32)


@pytest.mark.slow          # the default suite keeps WIDE's test without documents (test_ops_triton)
def test_int64_indexing_with_documents(device, monkeypatch):
    """``WIDE`` (int64 offsets, ``triton_backend.wide``) forced on: each row's document offsets read at ``b·T + i``
    in int64, both ops, the second row's batch offset included."""
    monkeypatch.setattr(triton_backend, "wide", lambda tensors, elements=0: True)
    q, k, v, dout = make(B=2, H=2, Hkv=1, T=37, Dh=16, seed=7, device=device)
    check(q, k, v, dout, ColumnSpec((0, 1, 2, 5, 8, 13)), None, SPLITS[:2], **FP32)
    check(q, k, v, dout, ColumnSpec(None, 2, FIB), torch.tensor(1.37, device=device), SPLITS[2:],
          rtol=1e-4, atol=1e-4)
