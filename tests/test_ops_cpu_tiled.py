"""The cpu kernel set's vector rows (issue 29) against the reference: production head sizes, ragged
lengths, grouped heads and packed documents, outputs and gradients of q, k, v and alpha; the alpha
gradient bit-identical for any thread count; more columns than the lanes hold (the generic rows
then); the backward's scratch kept between calls of any size; the generic rows kept selectable; outputs
written by streaming stores the same bits as by plain ones; the op in a forked child on one thread."""
import dataclasses
import functools
import os
import signal

import pytest
import torch

import fibattn
from fibattn.checks import UsageError
from fibattn.ops import cpu_backend
from fibattn.ops.columns import ColumnSpec, host_columns
from fibattn.ops.documents import offsets_unchecked
from fibattn.schedules import attended_distances

from op_helpers import (CPU_TOL as TOL, TWO_TAP_SPLITS, close, cpu_kernels, cpu_matches_reference, cpu_rows, doc_ids,
                        make, poison_scratch, run, two_tap_layout_matches_generic_rows)

pytestmark = pytest.mark.skipif(cpu_backend.unavailable("cpu") is not None, reason="cpu kernels unavailable")

@pytest.mark.parametrize("T,Dh,H,Hkv,W,docs", [
    (1, 64, 2, 1, 12, None),                 # one row
    (77, 64, 4, 2, 0, None),                 # W = 0, grouped, a ragged last tile
    (200, 32, 2, 2, 12, (5, 1, 70, 64)),     # packed documents across tiles, a document of one row
    (131, 128, 2, 1, 6, (40, 3)),            # Dh 128 (two register blocks), documents, grouped
    (97, 96, 2, 1, 12, (30, 2)),             # Dh 96: 12 vectors (a block of 8 and one of 4), documents
    (70, 48, 4, 2, 12, None),                # Dh 48: 6 vectors, grouped
    (83, 40, 2, 1, 12, (20, 1)),             # Dh 40: 5 vectors, documents
    (66, 24, 2, 2, 5, (3, 40)),              # Dh 24: 3 vectors, documents
    (50, 80, 2, 1, 12, None),                # Dh 80: 10 vectors, grouped
    (45, 256, 2, 2, 6, (10, 2)),             # Dh 256: 32 vectors, documents
])
@pytest.mark.parametrize("stream", [False, True])
def test_tiled_rows_match_reference(T, Dh, H, Hkv, W, docs, stream, monkeypatch):
    monkeypatch.setattr(cpu_backend, "stream_min_bytes", 0 if stream else None)   # True: every output streams
    q, k, v, dout = make(B=1, H=H, Hkv=Hkv, T=T, Dh=Dh, seed=T + Dh)
    ids = None if docs is None else doc_ids(1, T, docs)
    cpu_matches_reference(q, k, v, dout, W, 1.37, ids)


@pytest.mark.parametrize("alpha", [1.5, 1.0])
def test_rungs_at_whole_distances_match_reference(alpha):
    """alpha * b a whole number (at 1.5 every even Fibonacci number, at 1.0 all of them): the rung's second
    tap weighs 0, and the vector rows' weighted sums skip it; its dot still gives the alpha gradient's slope
    (the right derivative there, as the reference's)."""
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=300, Dh=64, seed=5)
    cpu_matches_reference(q, k, v, dout, 6, alpha, doc_ids(1, 300, (90, 1, 140)))


@pytest.mark.slow
@pytest.mark.parametrize("Dh", [32, 48, 64, 96, 128])
def test_tiled_rows_match_reference_long_packed(Dh):
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=1500, Dh=Dh, seed=Dh)
    cpu_matches_reference(q, k, v, dout, 12, 1.41, doc_ids(1, 1500, (700, 1, 300, 2)))


@pytest.mark.parametrize("kind", ["vector", "generic"])
def test_alpha_gradient_is_bit_identical_for_any_thread_count(kind):
    """Per-(head, block) partial sums added in a fixed order (not OpenMP's reduction order)."""
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=400, Dh=32, seed=11)
    cols = host_columns(ColumnSpec(None, 6, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233), None), 1.37, 400)
    one = cpu_kernels(q, k, v, dout, cols, kind, 1)
    for threads in (2, 3):
        many = cpu_kernels(q, k, v, dout, cols, kind, threads)
        for a, b in zip(one, many):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["vector", "generic"])
def test_both_backward_schedules_give_the_same_bits(kind):
    """With at least as many head groups as threads, a thread runs pass 2 of a block right after pass 1
    of the blocks that read it (cpu_kernels.c, fa_attn_bwd); otherwise pass 1 runs everywhere first.
    Grouped heads, packed documents (rows clamped at a document start, rows whose readers end with
    their document) and a sequence whose last block is short: the same bits either way."""
    q, k, v, dout = make(B=2, H=4, Hkv=2, T=333, Dh=32, seed=12)
    cols = host_columns(ColumnSpec(None, 5, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144), None), 1.29, 333)
    off = offsets_unchecked(torch.cat([doc_ids(1, 333, (70, 1, 190)), doc_ids(1, 333, (333,))]))
    cpu_kernels(q, k, v, dout, cols, kind, 1, off)                   # sizes the dS scratch; then poison it
    runs = {}
    for threads in (2, 5, 1):                                     # 4 head groups: 2 a thread, split, 1 thread
        poison_scratch()
        runs[threads] = cpu_kernels(q, k, v, dout, cols, kind, threads, off)
    for threads in (5, 1):
        for a, b in zip(runs[2], runs[threads]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_streaming_stores_give_the_same_bits(dtype, monkeypatch):
    """Outputs at least ``stream_min_bytes`` large (by default the threads' L2 caches) are written by
    streaming stores: out, dq, dk and dv, the last of a group's query heads finishing dk and dv. The
    same bits as plain stores, with grouped heads, documents, both backward schedules, the generic rows
    (which never stream) and an output not aligned to the vector size (which does not either)."""
    q, k, v, dout = (x.to(dtype) for x in make(B=2, H=4, Hkv=2, T=333, Dh=32, seed=13))
    cols = host_columns(ColumnSpec(None, 5, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144), None), 1.29, 333)
    off = offsets_unchecked(torch.cat([doc_ids(1, 333, (70, 1, 190)), doc_ids(1, 333, (333,))]))
    for kind in ("generic", "vector"):
        for threads, docs in ((1, off), (5, off), (2, None)):         # streamed and two-pass schedules
            monkeypatch.setattr(cpu_backend, "stream_min_bytes", 1 << 62)
            plain = cpu_kernels(q, k, v, dout, cols, kind, threads, docs)
            monkeypatch.setattr(cpu_backend, "stream_min_bytes", 0)
            for a, b in zip(plain, cpu_kernels(q, k, v, dout, cols, kind, threads, docs)):
                assert torch.equal(a, b)
    shifted = torch.empty(q.numel() + 1, dtype=dtype)[1:].view(q.shape)   # 4 or 8 bytes past an aligned start
    aux = torch.empty(cpu_backend.aux_shape(q, len(cols.lo), True), dtype=dtype)
    out, _ = cpu_backend.attn_forward(q, k, v, cols, 0.3, into=(shifted, aux))
    assert torch.equal(out, plain[0])                                  # the tiled rows' without documents
    poisoned = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))   # every row of dq, dk, dv is written
    grads = cpu_backend.attn_backward(q, k, v, out, aux, dout, cols, 0.3, need_dfrac=True, into=poisoned)
    for a, b in zip(grads, plain[1:]):
        assert torch.equal(a, b)
    assert cpu_backend._stream_out(q).value == 1
    monkeypatch.setattr(cpu_backend, "stream_min_bytes", None)
    l2, sizes = cpu_backend._l2_bytes(), cpu_backend.cpu_cache_bytes()     # sysfs, or 1 MiB where unreadable
    assert l2 == sizes.get(2, 1 << 20) and all(n > 0 for n in sizes.values())
    assert l2 >= 1 << 14 and cpu_backend._stream_out(torch.empty(1 << 14, dtype=torch.uint8)).value == 0
    assert cpu_backend._stream_out(torch.empty(l2 * torch.get_num_threads(), dtype=torch.uint8)).value == 1


@pytest.mark.parametrize("kind", ["vector", "generic"])
def test_a_forward_without_backward_saves_no_state(kind, monkeypatch):
    """Under no_grad (eval, generation) the public op asks for no saved state: the kernels skip P and
    the slopes, and out is the same bits as a forward that saves them (integer and interpolated
    columns, documents, grouped heads)."""
    monkeypatch.setattr(cpu_backend, "_generic_rows", kind == "generic")
    q, k, v, _ = make(B=2, H=4, Hkv=2, T=150, Dh=32, seed=14)
    ids = doc_ids(2, 150, (60, 1, 40))
    off = offsets_unchecked(ids)
    for cols in (host_columns(ColumnSpec((0, 1, 2, 5, 9, 40)), None, 150),
                 host_columns(ColumnSpec(None, 4, (1, 2, 3, 5, 8, 13, 21, 34), None), 1.37, 150)):
        out, aux = cpu_backend.attn_forward(q, k, v, cols, 0.3, off=off)
        bare, none = cpu_backend.attn_forward(q, k, v, cols, 0.3, off=off, save=False)
        assert none is None and aux is not None and torch.equal(out, bare)
    splits = []
    real = cpu_backend._split
    monkeypatch.setattr(cpu_backend, "_split", lambda *a: splits.append(1) or real(*a))
    dists = attended_distances(4, 1.5, "fib", 150)
    with torch.no_grad():
        plain = fibattn.sparse_attention(q, k, v, dists, backend="cpu", document_ids=ids)
        frac = fibattn.interpolated_sparse_attention(q, k, v, alpha=1.37, base="fib", window=4, backend="cpu")
    assert not splits                                              # neither call handed the kernels a state
    with_state = fibattn.sparse_attention(q.requires_grad_(), k, v, dists, backend="cpu", document_ids=ids)
    assert splits and torch.equal(plain, with_state.detach())
    assert torch.equal(frac, fibattn.interpolated_sparse_attention(q, k, v, alpha=1.37, base="fib", window=4,
                                                                   backend="cpu").detach())


def test_generic_rows_agree_with_vector_rows_and_the_old_switch_is_named(monkeypatch, caplog):
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=150, Dh=64, seed=2)
    cols = host_columns(ColumnSpec(None, 12, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89), None), 1.5, 150)
    close(cpu_kernels(q, k, v, dout, cols, "vector", 2), cpu_kernels(q, k, v, dout, cols, "generic", 2),
          rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("FIBATTN_CPU_KERNEL", "rows")       # no longer a choice: a warning, not silence
    with caplog.at_level("WARNING", logger="fibattn"):
        assert cpu_backend._load().lib is not None
    assert "FIBATTN_CPU_KERNEL is no longer read" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_common_head_sizes_run_the_vector_rows(dtype):
    """Head sizes of 2, 3, 4, 5, 6, 8, 10, 12, 16 or 32 SIMD vectors take the vector rows, every other the
    generic rows; with AVX2 (8 fp32 lanes) that is fp32 Dh 16, 24, 32, 40, 48, 64, 80, 96, 128 and 256."""
    nv = functools.partial(cpu_backend.vector_rows, dtype)
    lanes = next(d for d in range(1, 65) if nv(2 * d))
    for dh in range(1, 40 * lanes):
        want = dh // lanes if dh % lanes == 0 and dh // lanes in (2, 3, 4, 5, 6, 8, 10, 12, 16, 32) else 0
        assert nv(dh) == want, dh
    if dtype == torch.float32 and lanes == 8:
        sizes = (16, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256)
        assert [nv(dh) for dh in sizes] == [2, 3, 4, 5, 6, 8, 10, 12, 16, 0, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_more_columns_than_lanes_run_the_generic_rows(dtype):
    """A row's columns must fit 16 vectors of lanes (two-tap columns count twice); past that the
    generic rows run, with the same results."""
    q, k, v, dout = (x.to(dtype) for x in make(B=1, H=2, Hkv=1, T=300, Dh=32, seed=5))
    wide = host_columns(ColumnSpec(tuple(range(0, 260))), None, 300)       # 260 columns > 16 * 8 lanes
    rungs = host_columns(ColumnSpec(None, 40, tuple(range(1, 120)), None), 1.7, 300)   # two taps each
    for cols in (wide, rungs):
        close(cpu_kernels(q, k, v, dout, cols, "vector", 2), cpu_kernels(q, k, v, dout, cols, "generic", 2),
              rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("before,two,after", TWO_TAP_SPLITS)
def test_two_tap_layouts_match_the_generic_rows(before, two, after, dtype):
    """A row's dots fill its lanes densely: the columns' first taps, then the second taps of the two-tap
    columns (one run), and only the used lanes of the last group are dotted (cpu_kernels.c, lanes_t)."""
    two_tap_layout_matches_generic_rows(before, two, after, dtype)


def test_backward_scratch_is_reused_across_sizes():
    """dS lives in a buffer the thread keeps (the largest asked for); calls of other sizes after a
    larger one still match the reference."""
    cpu_backend._scratch.bufs = {}
    cols = host_columns(ColumnSpec((0, 1, 2, 3, 5, 8)), None, 64)
    for T in (64, 17, 40):
        q, k, v, dout = make(B=1, H=2, Hkv=2, T=T, Dh=16, seed=T)
        c = host_columns(ColumnSpec((0, 1, 2, 3, 5, 8)), None, T) if T != 64 else cols
        got = cpu_kernels(q, k, v, dout, c, "vector", 1)
        want = cpu_kernels(q.double(), k.double(), v.double(), dout.double(), c, "generic", 1)
        close([g.double() for g in got[:4]], want[:4], **TOL)
    bufs = cpu_backend._scratch.bufs
    assert bufs[torch.float32].numel() == 2 * 64 * 6     # (B, H, T, C) of the largest call


def _mixed(q, k, v, dout, cols, fwd_kind, bwd_kind):
    """Forward with one kind of rows, backward with the other (the slopes saved by either serve both)."""
    with cpu_rows(fwd_kind):
        out, aux = cpu_backend.attn_forward(q, k, v, cols, 0.3)
    with cpu_rows(bwd_kind):
        return (out, *cpu_backend.attn_backward(q, k, v, out, aux, dout, cols, 0.3, need_dfrac=True))


def test_interpolated_saved_state_holds_the_score_slopes():
    """An interpolated forward saves P and the slopes q . (k_hi - k_lo) ((B, H, 2T, C), the shape the
    op's fake implementation gives); the alpha gradient is the same from either kind of rows' slopes."""
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=180, Dh=32, seed=9)
    spec = ColumnSpec(None, 5, (1, 2, 3, 5, 8, 13, 21, 34, 55, 89), None)
    cols = host_columns(spec, 1.45, 180)
    out, aux = cpu_backend.attn_forward(q, k, v, cols, 0.3)
    assert aux.shape == cpu_backend.aux_like(q, spec).shape == (1, 2, 360, len(cols.lo))
    exact = host_columns(ColumnSpec((0, 1, 2, 7)), None, 180)
    assert cpu_backend.attn_forward(q, k, v, exact, 0.3)[1].shape == (1, 2, 180, 4)
    want = _mixed(q, k, v, dout, cols, "vector", "vector")
    for kinds in (("generic", "vector"), ("vector", "generic")):
        close(_mixed(q, k, v, dout, cols, *kinds), want, rtol=1e-5, atol=1e-5)
    unsaved = dataclasses.replace(cols, interpolated=False)      # no slopes saved: the backward's own dots
    close(_mixed(q, k, v, dout, unsaved, "vector", "vector"), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(UsageError, match=r"the saved state must have shape \(1, 2, 180, 16\) or \(1, 2, 360, 16\)"):
        cpu_backend.attn_backward(q, k, v, out, aux[:, :, :179], dout, cols, 0.3)


@pytest.mark.parametrize("docs", [None, (341, 1, 250)])     # a block starts 42 rows into a document
def test_streamed_blocks_match_reference(docs):
    """Blocks whose rows all see every column (none reaches its document start) run lane group by lane
    group and tap by tap over the block (fwd_vblock, bwd_vblock); short rungs make most blocks such,
    and the blocks that straddle a document start run row by row, in the same call."""
    T = 640
    q, k, v, dout = make(B=2, H=4, Hkv=2, T=T, Dh=64, seed=21)
    ids = None if docs is None else doc_ids(2, T, docs)
    dists = [0, 1, 2, 3, 4, 5, 6, 9, 17, 30, 47]
    exact = [x.double() for x in (q, k, v, dout)]

    def integer(backend):
        return lambda q, k, v: fibattn.sparse_attention(q, k, v, dists, backend=backend, document_ids=ids)

    def frac(backend):
        return lambda q, k, v, a: fibattn.interpolated_sparse_attention(
            q, k, v, alpha=a, base=[1, 2, 3, 5, 8, 13, 21, 34], window=4, backend=backend, document_ids=ids)
    a = torch.tensor(1.37)
    close([g.double() for g in run(integer("cpu"), q, k, v, dout)], run(integer("reference"), *exact), **TOL)
    got, want = run(frac("cpu"), q, k, v, dout, a), run(frac("reference"), *exact, a.double())
    close([g.double() for g in got[:4]], want[:4], **TOL)
    torch.testing.assert_close(got[4].double(), want[4], rtol=1e-4, atol=1e-4 * max(want[4].abs().item(), 1.0))


def test_a_build_that_fails_gives_the_reason_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """The library builds from two halves at once (float, double); a half that does not compile makes
    the backend unavailable with gcc's message, and no object or library is left in the cache."""
    bad = tmp_path / "cpu_kernels.c"
    bad.write_text(cpu_backend._SOURCE.read_text().replace("typedef int64_t i64;", "typedef int64_t i64 oops;"))
    monkeypatch.setattr(cpu_backend, "_SOURCE", bad)
    monkeypatch.setenv("FIBATTN_CACHE", str(tmp_path / "cache"))
    build = cpu_backend._load()
    assert build.lib is None and "-DFA_PART=1" in build.reason and "oops" in build.reason
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_on_one_thread_runs_the_op():
    """README, The op: after the parent ran the kernels on two threads, a forked child that sets one
    thread (as DataLoader workers do) gets the parent's bits; more threads would hang in OpenMP, as
    PyTorch's own ops do. An alarm ends the child if it does not finish."""
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=300, Dh=64, seed=5)

    def op(*x):
        return fibattn.sparse_attention(*x, [0, 1, 2, 3, 20, 90], backend="cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = run(op, q, k, v, dout)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(120)                                  # a hang ends the child, not the test run
                torch.set_num_threads(1)
                code = 0 if all(torch.equal(a, b) for a, b in zip(run(op, q, k, v, dout), want)) else 3
            finally:
                os._exit(code)
    finally:
        torch.set_num_threads(before)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == 0, f"child exit {code}: 3, its results differ from the parent's; -14, it hung"
