"""The cpu kernels at both SIMD widths, whichever one this machine runs by default (cpu_kernels.c,
FA_VBYTES): each built here (AVX-512's 64 bytes, lowered to pairs of AVX2 registers where the machine has
only AVX2; AVX2's 32) and checked against the reference, so that the lane logic of both widths is tested on
any machine, not only the width the machine's own build runs (the mutation check selects this file for
both). The AVX-512 intrinsics themselves are compiled for an AVX-512 target, as a machine that has one
builds them."""
import functools
import platform
import shutil

import pytest
import torch

import fibattn
from fibattn.ops import cpu_backend
from fibattn.ops.columns import ColumnSpec, host_columns

from op_helpers import (TWO_TAP_SPLITS, close, cpu_kernels, cpu_matches_reference, doc_ids, make,
                        two_tap_layout_matches_generic_rows, use_kernel_build)

pytestmark = pytest.mark.skipif(cpu_backend.unavailable("cpu") is not None, reason="cpu kernels unavailable")


@pytest.fixture(scope="module", params=[32, 64], ids=["32B", "64B"])
def width(request, tmp_path_factory):
    """A vector width in bytes, with the backend switched to a library built for it."""
    width = request.param
    patch = pytest.MonkeyPatch()
    # -O1: gcc lowers the wider vectors 3x slower at -O2 (30 s), and the lanes' logic is the same
    flags = tuple("-O1" if f == "-O2" else f for f in cpu_backend._CFLAGS)
    # and the dots' order a machine of that width builds (cpu_kernels.c, FA_VREGS: AVX-512 has 32)
    regs = f"-DFA_VREGS={32 if width == 64 else 16}"
    use_kernel_build(patch, tmp_path_factory.mktemp("kernels"), (*flags, f"-DFA_VBYTES={width}", regs, "-Wno-psabi"))
    yield width
    patch.undo()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_build_runs_its_width(width, dtype):
    lanes = width // torch.empty((), dtype=dtype).element_size()
    nv = functools.partial(cpu_backend.vector_rows, dtype)
    assert [nv(lanes * n) for n in (1, 2, 4, 5, 7, 8)] == [0, 2, 4, 5, 0, 8]


@pytest.mark.parametrize("T,Dh,H,Hkv,W,docs,dtype", [
    (1, 64, 2, 1, 12, None, torch.float32),                # one row
    (77, 64, 4, 2, 0, None, torch.float32),                # W = 0, grouped, a ragged last block
    (200, 32, 2, 2, 12, (5, 1, 70, 64), torch.float32),    # documents across blocks, a document of one row
    (131, 128, 2, 1, 6, (40, 3), torch.float32),           # Dh 128, documents, grouped
    (97, 96, 2, 1, 12, (30, 2), torch.float32),            # Dh 96
    (45, 256, 2, 2, 6, (10, 2), torch.float32),            # Dh 256
    (150, 64, 4, 2, 12, (60, 1), torch.float64),           # the double kernels
    (1025, 48, 2, 1, 12, (700, 1), torch.float32),         # Dh 48, past a tile's multiple
    (90, 24, 2, 2, 3, None, torch.float32),                # Dh 24, 40, 7: vector rows at one width, the
    (90, 40, 2, 1, 12, (20, 1), torch.float32),            # generic rows (and their vector tails) at the other
    (90, 80, 2, 2, 12, None, torch.float32),               # Dh 80: 5 vectors of 16, 10 of 8
    (61, 7, 3, 1, 5, (9, 1), torch.float64),
])
@pytest.mark.parametrize("stream", [False, True])
def test_each_width_matches_reference(width, T, Dh, H, Hkv, W, docs, dtype, stream, monkeypatch):
    monkeypatch.setattr(cpu_backend, "stream_min_bytes", 0 if stream else None)
    q, k, v, dout = (x.to(dtype) for x in make(B=1, H=H, Hkv=Hkv, T=T, Dh=Dh, seed=T + Dh))
    cpu_matches_reference(q, k, v, dout, W, 1.37, None if docs is None else doc_ids(1, T, docs))


def test_each_width_is_bit_identical_across_threads_and_agrees_with_generic_rows(width):
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=400, Dh=64, seed=11)
    cols = host_columns(ColumnSpec(None, 6, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233), None), 1.37, 400)
    one = cpu_kernels(q, k, v, dout, cols, "vector", 1)
    for a, b in zip(one, cpu_kernels(q, k, v, dout, cols, "vector", 3)):
        assert torch.equal(a, b)
    close(one, cpu_kernels(q, k, v, dout, cols, "generic", 2), rtol=1e-5, atol=1e-5)
    wide = host_columns(ColumnSpec(tuple(range(0, 300))), None, 400)      # more columns than 16 vectors' lanes
    close(cpu_kernels(q, k, v, dout, wide, "vector", 2), cpu_kernels(q, k, v, dout, wide, "generic", 2),
          rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("before,two,after", TWO_TAP_SPLITS)
def test_each_width_two_tap_layouts_match_the_generic_rows(width, before, two, after):
    """The dot lanes' layout (test_ops_cpu_tiled.py) with each width's groups and last groups."""
    two_tap_layout_matches_generic_rows(before, two, after, torch.float32)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None,
                    reason="an x86-64 gcc")
def test_avx512_build_compiles(tmp_path):
    """Both halves, as ``-march=native`` builds them on an AVX-512 machine (its masked loads and stores
    and streaming stores are intrinsics that an AVX2 build never compiles)."""
    flags = [f for f in cpu_backend._CFLAGS if not f.startswith("-march")]
    cpu_backend._run([["gcc", *flags, "-march=x86-64-v4", "-Werror", f"-DFA_PART={part}", "-c", "-o",
                       str(tmp_path / f"part{part}.o"), str(cpu_backend._SOURCE)] for part in cpu_backend._PARTS])


def test_each_width_keeps_large_scores_finite(width):
    """Scores of several hundred: exp only stays finite when each row's max over its lanes is right (dout
    scaled down as q is scaled up, so that dk keeps its size against the tolerance)."""
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=150, Dh=64, seed=3)
    cpu_matches_reference(q * 80, k, v, dout / 80, 12, 1.37, doc_ids(1, 150, (40, 1)))


def test_each_width_takes_each_rows_max_over_all_its_lanes(width):
    """Two columns in a group's upper lanes (distances 8 and 9: lanes 8 and 9 of 16 at 64 B) far above every other
    score and one logit apart: a row max taken over fewer lanes lets exp's range flatten their ratio."""
    T, Dh = 64, 64
    i = torch.arange(T)
    q = torch.zeros(1, 1, T, Dh)
    q[0, 0, i, i % 16] = 800.0                     # query i meets key i - 8 at 800 and key i - 9 at 792
    k = torch.zeros(1, 1, T, Dh)
    k[0, 0, i, (i + 8) % 16] = 1.0
    k[0, 0, i, (i + 9) % 16] = 0.99
    v = torch.randn(1, 1, T, Dh, generator=torch.Generator().manual_seed(5))
    dists = list(range(13)) + [20, 30]
    got = fibattn.sparse_attention(q, k, v, dists, backend="cpu")
    want = fibattn.sparse_attention(*(x.double() for x in (q, k, v)), dists, backend="reference")
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
