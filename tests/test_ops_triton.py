"""The ``triton`` backend against the reference: outputs and gradients (q, k, v, alpha).

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``conftest.py``);
``-m gpu`` runs the same cases natively on CUDA. The interpreter's cost is per program and
per column, so shapes are small but cross tiles (T = 257 spans five 64-row tiles).
"""
import pytest
import torch

import fibattn
from fibattn.ops import backend_available, backends, triton_backend, triton_config
from fibattn.schedules import attended_distances
from op_helpers import FP32, FP64, alpha_grad_matches_fd, bf16_check, close, interp, make, run, sparse

DEVICES = [
    pytest.param("cpu", id="interpret"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs CUDA")]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    why = backend_available("triton", torch.device(request.param))
    if why is not None:
        pytest.skip(f"triton backend unavailable on {request.param}: {why}")
    return request.param


# ----------------------------------------------------------------------------- integer op
INTEGER = [  # (T, H, Hkv, Dh, distances or (W, alpha, base))
    (1, 2, 2, 32, [0, 5]),
    (2, 4, 2, 32, [0, 1, 3]),
    (17, 4, 1, 32, [0, 3, 16, 17, 40]),                 # 17 and 40 are never valid
    (64, 2, 2, 64, (12, 1.5, "fib:8")),
    (257, 4, 1, 64, (2, 1.5, "fib:12")),
    (97, 4, 2, 128, (0, 1.3, "pow2")),                  # W = 0
    (33, 6, 2, 24, (4, 1.0, "fib:9")),                  # a group of 3, a head size that is not a power of two
]


def _dists(spec, T):
    return spec if isinstance(spec, list) else attended_distances(spec[0], spec[1], spec[2], T)


@pytest.mark.parametrize("case", INTEGER, ids=lambda c: f"T{c[0]}-g{c[1] // c[2]}-d{c[3]}")
def test_integer_fp32_matches_reference(device, case):
    T, H, Hkv, Dh, spec = case
    q, k, v, dout = make(B=2 if T < 100 else 1, H=H, Hkv=Hkv, T=T, Dh=Dh, seed=T, device=device)
    dists = _dists(spec, T)
    want = run(sparse(dists, "reference"), *(x.double() for x in (q, k, v, dout)))
    got = run(sparse(dists, "triton"), q, k, v, dout)
    assert all(g.dtype == torch.float32 for g in got)
    close([g.double() for g in got], want, **FP32)


def test_integer_fp64_noncontiguous_exact(device):
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=65, Dh=16, dtype=torch.float64, noncontig=True, seed=1, device=device)
    assert not q.is_contiguous()
    dists = [0, 1, 2, 7, 20, 64, 200]
    close(run(sparse(dists, "triton", scale=0.3), q, k, v, dout),
          run(sparse(dists, "reference", scale=0.3), q, k, v, dout), **FP64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_integer_half_within_reference_error(device, dtype):
    q, k, v, dout = make(H=4, Hkv=2, T=97, Dh=32, dtype=torch.float64, seed=3, device=device)
    bf16_check(sparse(attended_distances(6, 1.5, "fib:10", 97), "triton"),
               sparse(attended_distances(6, 1.5, "fib:10", 97), "reference"), q, k, v, dout, dtype=dtype)


def test_probabilities_without_their_split_keep_half_precision(device, monkeypatch):
    """``FIBATTN_TRITON_SPLIT_P=0`` (issue 56 item 3: to time what the split costs): ``P·V`` takes the
    probabilities as one half-precision part — still within a few units in the last place, and not the same
    numbers as with the split (the setting acts)."""
    from op_helpers import ulps
    q, k, v, dout = make(H=2, Hkv=1, T=50, Dh=32, dtype=torch.float64, seed=3, device=device)
    dists = attended_distances(6, 1.5, "fib:10", 50)
    lo = [x.to(torch.bfloat16) for x in (q, k, v, dout)]
    truth = run(sparse(dists, "reference"), *(x.double() for x in lo))
    split = run(sparse(dists, "triton"), *lo)
    monkeypatch.setenv("FIBATTN_TRITON_SPLIT_P", "0")
    whole = run(sparse(dists, "triton"), *lo)
    for name, a, b in zip(("out", "dq", "dk", "dv"), whole, truth):
        assert ulps(a, b, torch.bfloat16) <= 16, name
    assert not torch.equal(whole[0], split[0])


# ----------------------------------------------------------------------------- interpolated op
INTERP = [  # (T, H, Hkv, W, alpha, base, reach)
    (1, 2, 1, 0, 1.2, "fib:6", None),
    (17, 4, 2, 0, 0.7, "fib:8", None),
    (64, 4, 1, 6, 1.37, "pow2", None),
    (257, 2, 2, 3, 0.55, [9, 2, 1, 5, 41, 40, 300], 100),     # unsorted, 41 and 40 share lo 22, reach caps 300
    (40, 2, 1, 2, 2.5, [3, 4, 7], None),                        # frac 0.5: round-half-even in the plan
]


@pytest.mark.parametrize("case", INTERP, ids=lambda c: f"T{c[0]}-W{c[3]}")
def test_interpolated_fp64_matches_reference(device, case):
    T, H, Hkv, W, alpha, base, reach = case
    q, k, v, dout = make(B=2 if T < 100 else 1, H=H, Hkv=Hkv, T=T, Dh=8, dtype=torch.float64, seed=T, device=device)
    a = torch.tensor(alpha, dtype=torch.float64, device=device)
    close(run(interp(W, base, "triton", reach=reach), q, k, v, dout, a),
          run(interp(W, base, "reference", reach=reach), q, k, v, dout, a), **FP64)


def test_interpolated_fp32_cpu_alpha_with_device_tensors(device):
    """alpha as a float32 CPU parameter next to device tensors: the plan is built on the device."""
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=130, Dh=64, seed=7, device=device)
    a = torch.tensor(1.43)
    want = run(interp(12, "fib:12", "reference"), *(x.double() for x in (q, k, v, dout)), a.double())
    got = run(interp(12, "fib:12", "triton"), q, k, v, dout, a)
    assert got[-1].dtype == torch.float32 and got[-1].device.type == "cpu"
    close([g.double() for g in got], want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow          # the default suite keeps the integer op's bf16 check and the interpolated fp32 ones
def test_interpolated_bf16_within_reference_error(device):
    q, k, v, dout = make(H=4, Hkv=2, T=97, Dh=32, dtype=torch.float64, seed=4, device=device)
    bf16_check(interp(6, "fib:10", "triton"), interp(6, "fib:10", "reference"), q, k, v, dout,
               torch.tensor(1.3, device=device))


@pytest.mark.parametrize("alpha,base", [pytest.param(1.0, "fib:10", marks=pytest.mark.slow), (2.0, "pow2")])
def test_interpolated_equals_integer_for_integer_targets(device, alpha, base):
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=120, Dh=16, dtype=torch.float64, seed=6, device=device)
    a = torch.tensor(alpha, dtype=torch.float64, device=device)
    got = run(interp(4, base, "triton"), q, k, v, dout, a)
    want = run(sparse(attended_distances(4, alpha, base, 120), "triton"), q, k, v, dout)
    close(got[:4], want, **FP64)
    assert got[4] != 0          # d/d alpha exists at integer targets (the second tap is still read)


def test_alpha_gradient_matches_finite_differences(device):
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=80, Dh=6, dtype=torch.float64, seed=5, device=device)
    alpha_grad_matches_fd(interp(6, "fib:10", "triton"), q, k, v, dout)


TILE_DISTS = ([0, 1, 2, 15, 16, 17, 32, 48, 82, 83], [0, 16, 31, 64], list(range(20)) + [47])
TILE_ALPHAS = (16.0, 15.5, 8.25)            # lo = 16, 32, 48, 80 exactly; halves; quarters


@pytest.mark.parametrize("case", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_tile_boundaries(device, case):
    """16-row tiles (the default): rungs that fall exactly on a tile's first row (lo = 16, 32, 48),
    one row short of it and one past it, a band that spans two key tiles, T not a multiple of
    the tile, a rung whose key pass needs the next tile's first query row, and W = 0. The first
    case holds every kind; the others (-m slow) vary them."""
    q, k, v, dout = make(B=1, H=4, Hkv=2, T=83, Dh=8, dtype=torch.float64, seed=11, device=device)
    dists = TILE_DISTS[case]
    close(run(sparse(dists, "triton"), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP64)
    for alpha in TILE_ALPHAS[case:case + 1]:
        a = torch.tensor(alpha, dtype=torch.float64, device=device)
        close(run(interp(0, [1, 2, 3, 5], "triton"), q, k, v, dout, a),
              run(interp(0, [1, 2, 3, 5], "reference"), q, k, v, dout, a), **FP64)


def test_band_wider_than_one_key_block(device):
    """W = 49: a tile's M + W = 65 band keys take two 64-key blocks, the second holding only the tile's
    last key (forward, dq) or its last band query row (dk, dv); W = 47 and 48 fit one block. Odd and
    even rung counts (rungs go RB = 2 at a time), one of them on a tile's first row (lo = 64)."""
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=90, Dh=8, dtype=torch.float64, seed=13, device=device)
    for dists in (list(range(50)), list(range(49)) + [64], list(range(48)) + [55, 64, 89], list(range(50)) + [61, 75]):
        close(run(sparse(dists, "triton"), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP64)


def test_small_tiles(device, monkeypatch):
    """32-row tiles: columns and clamped second taps that cross several tile boundaries."""
    monkeypatch.setenv("FIBATTN_TRITON_BLOCK_M", "32")
    q, k, v, dout = make(B=1, H=2, Hkv=1, T=50, Dh=8, dtype=torch.float64, seed=9, device=device)
    a = torch.tensor(1.37, dtype=torch.float64, device=device)
    close(run(interp(2, "fib:9", "triton"), q, k, v, dout, a),
          run(interp(2, "fib:9", "reference"), q, k, v, dout, a), **FP64)
    dists = attended_distances(2, 1.5, "fib:9", 50)
    close(run(sparse(dists, "triton"), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP64)


@pytest.mark.parametrize("chunk, rb", [("16", "1"), ("16", "2"), ("4", "8"), ("2", "8")])
def test_either_candidate_of_each_choice(device, monkeypatch, chunk, rb):
    """The tile choices' candidates (``triton_config.config``; the interpreter takes the first unless told): the
    rungs in one chunk of the tile at one or two rungs a step (the key pass too, its blocks placed by selects, or
    by products at two rungs a step), and in chunks of 4 and 2 positions at 8 rungs a step (more than there are:
    slots past the rungs in use), over odd and even rung counts and a group of four."""
    monkeypatch.setenv("FIBATTN_TRITON_RUNG_CHUNK", chunk)
    monkeypatch.setenv("FIBATTN_TRITON_RUNG_STEP", rb)
    monkeypatch.setenv("FIBATTN_TRITON_RB_KEY_PASS", "2" if rb == "8" else rb)
    monkeypatch.setenv("FIBATTN_TRITON_KEY_PASS_PRODUCTS", "0" if rb in ("1", "8") else "1")
    q, k, v, dout = make(B=1, H=4, Hkv=1, T=70, Dh=16, dtype=torch.float64, seed=21, device=device)
    for base in ("fib:7", "fib:8"):          # 5 and 6 rungs, integer and two-tap
        a = torch.tensor(1.37, dtype=torch.float64, device=device)
        close(run(interp(3, base, "triton"), q, k, v, dout, a),
              run(interp(3, base, "reference"), q, k, v, dout, a), **FP64)
        dists = attended_distances(3, 1.5, base, 70)
        close(run(sparse(dists, "triton"), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP64)


def test_a_group_of_eight_takes_the_rungs_in_chunks_of_two(device):
    """Eight query heads a key/value head: 128-row tiles in eight chunks of 2 positions, 8 rungs a step (more slots
    than rungs in use), both ops against the reference in fp64, T not a tile multiple."""
    assert triton_config.config(8, 16, 3)["RUNGS"][0] == (2, 8)
    q, k, v, dout = make(B=1, H=8, Hkv=1, T=41, Dh=16, dtype=torch.float64, seed=31, device=device)
    a = torch.tensor(1.37, dtype=torch.float64, device=device)
    close(run(interp(3, "fib:8", "triton"), q, k, v, dout, a), run(interp(3, "fib:8", "reference"), q, k, v, dout, a),
          **FP64)
    dists = attended_distances(3, 1.5, "fib:8", 41)
    close(run(sparse(dists, "triton"), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP64)


def test_int64_indexing_matches_the_reference(device, monkeypatch):
    """``WIDE`` (``triton_backend.wide``: tensors whose offsets may reach 2**31) indexes in int64; forced here on
    small tensors: non-contiguous, two batches, a group of two, both ops, against the reference (documents:
    ``test_ops_documents_triton``, ``-m slow``)."""
    monkeypatch.setattr(triton_backend, "wide", lambda tensors, elements=0: True)
    q, k, v, dout = make(B=2, H=4, Hkv=2, T=45, Dh=16, dtype=torch.float64, noncontig=True, seed=41, device=device)
    a = torch.tensor(1.37, dtype=torch.float64, device=device)
    close(run(interp(3, "fib:8", "triton"), q, k, v, dout, a), run(interp(3, "fib:8", "reference"), q, k, v, dout, a),
          **FP64)
    dists = attended_distances(3, 1.5, "fib:8", 45)
    close(run(sparse(dists, "triton"), q, k, v, dout), run(sparse(dists, "reference"), q, k, v, dout), **FP64)


def test_int64_indexing_is_chosen_by_the_reach_of_offsets():
    """int32 offsets while every element offset of the tensors, and every index into the per-row buffers, stays
    below 2**31 (strides count, not sizes); int64 from there."""
    def meta(shape, stride=None):
        return torch.empty_strided(shape, stride or torch.empty(shape, device="meta").stride(), device="meta")
    assert not triton_backend.wide([meta((1, 32, 2 ** 20 - 1, 64))])
    assert triton_backend.wide([meta((1, 32, 2 ** 20, 64))])                           # reach exactly 2**31
    assert triton_backend.wide([meta((2, 4, 16, 64)), meta((2, 4, 16, 64), (2 ** 31, 64, 256, 1))])
    assert not triton_backend.wide([meta((2, 4, 16, 64))], 2 ** 31 - 1)
    assert triton_backend.wide([meta((2, 4, 16, 64))], 2 ** 31)


# ----------------------------------------------------------------------------- choice and configuration
def test_auto_prefers_triton_on_cuda_and_says_why_not(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_backend, "unavailable", lambda device: None)
    assert backends._auto(cuda) == ("triton", None)
    monkeypatch.setattr(triton_backend, "unavailable", lambda device: "triton is not importable (test)")
    name, why = backends._auto(cuda)
    assert name == "torch" and "triton is not importable" in why


@pytest.mark.parametrize("key, value, message", [
    ("FIBATTN_TRITON_BLOCK_M", "24", "FIBATTN_TRITON_BLOCK_M must be a power of two, got 24"),
    ("FIBATTN_TRITON_BLOCK_M", "8", "FIBATTN_TRITON_BLOCK_M must be at least 16"),
    ("FIBATTN_TRITON_BLOCK_Q", "8", "FIBATTN_TRITON_BLOCK_Q must be at least 16"),
    ("FIBATTN_TRITON_RUNG_STEP", "3", "FIBATTN_TRITON_RUNG_STEP must be a power of two, got 3"),
    ("FIBATTN_TRITON_RUNG_STEP", "2", "FIBATTN_TRITON_RUNG_STEP must be at least 4 at rung chunks of 4 .*got 2"),
    ("FIBATTN_TRITON_RUNG_CHUNK", "32",
     "FIBATTN_TRITON_RUNG_CHUNK must be at most FIBATTN_TRITON_BLOCK_M .16., got 32"),
    ("FIBATTN_TRITON_BLOCK_N_TWO_TAP_DOCS", "8", "FIBATTN_TRITON_BLOCK_N_TWO_TAP_DOCS must be at least 16"),
    ("FIBATTN_TRITON_STAGES", "0", "FIBATTN_TRITON_STAGES must be one of 1, 2, 3, 4, got '0'"),
    ("FIBATTN_TRITON_SPLIT_P", "yes", "FIBATTN_TRITON_SPLIT_P must be one of 0, 1, got 'yes'")])
def test_block_size_override_is_checked(key, value, message, monkeypatch):
    monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        triton_config.config(4, 64, 12)


@pytest.mark.parametrize("group, head_dim, block_q, chunk", [(1, 64, 32, 16), (2, 64, 32, 8), (4, 64, 16, 4),
                                                            (8, 64, 16, 2), (4, 128, 16, 4)])
def test_tiles_and_the_candidates_of_each_choice(group, head_dim, block_q, chunk, monkeypatch):
    """Issue 56: the key pass's band takes at most 64 query rows over the group's heads (at least 16 positions); the
    forward and query pass take the rungs in chunks of ``16 / G`` positions (16 rows), at as many rungs a step as
    make 16 columns a chunk (at least 2), then the one-chunk tile at 2 and 1; the key pass's rungs a step (with its
    blocks placed by products, then by selects) and the two-tap forward's band step with documents are candidates
    too, the larger step first. Without a chooser (the interpreter) the first is taken; a setting in the environment
    is the only candidate (the GPU check's sweep times the others)."""
    cfg = triton_config.config(group, head_dim, 12)
    step = max(2, 16 // chunk)
    assert (cfg["BLOCK_N"], cfg["BLOCK_Q"], cfg["MC"], cfg["RB"]) == (32, block_q, chunk, step)
    assert cfg["RUNGS"] == tuple(dict.fromkeys(((chunk, step), (16, 2), (16, 1))))
    assert (cfg["RB_KEY_PASS"], cfg["BLOCK_N_TWO_TAP_DOCS"]) == (((2, 1), (2, 0), (1, 1), (1, 0)), (32, 16))
    fwd, dq, dkdv = triton_config.forward_tiles, triton_config.query_pass_rungs, triton_config.key_pass_rungs
    for two, docs in ((True, True), (True, False), (False, True)):
        assert fwd(cfg, two, docs) == {"BLOCK_N": 32, "MC": chunk, "RB": step}
        assert dq(cfg, two, docs) == {"MC": chunk, "RB": step} and dkdv(cfg, two, docs) == {"RBK": 2, "PRODUCTS": 1}
    assert triton_config.config(group, head_dim, 0)["BLOCK_N_TWO_TAP_DOCS"] == (16,)      # BLOCK_N is 16 there
    for key, value in (("FIBATTN_TRITON_BLOCK_Q", "16"), ("FIBATTN_TRITON_RUNG_CHUNK", "16"),
                       ("FIBATTN_TRITON_RUNG_STEP", "1"), ("FIBATTN_TRITON_RB_KEY_PASS", "1"),
                       ("FIBATTN_TRITON_KEY_PASS_PRODUCTS", "0"), ("FIBATTN_TRITON_BLOCK_N_TWO_TAP_DOCS", "16")):
        monkeypatch.setenv(key, value)
    cfg = triton_config.config(group, head_dim, 12)
    assert (cfg["BLOCK_Q"], cfg["RUNGS"], cfg["RB_KEY_PASS"], cfg["BLOCK_N_TWO_TAP_DOCS"]) == (
        16, ((16, 1),), ((1, 0),), (16,))
    assert (fwd(cfg, True, True), dq(cfg, True), dkdv(cfg, False)) == (
        {"BLOCK_N": 16, "MC": 16, "RB": 1}, {"MC": 16, "RB": 1}, {"RBK": 1, "PRODUCTS": 0})
    monkeypatch.delenv("FIBATTN_TRITON_RUNG_STEP")
    assert triton_config.config(group, head_dim, 12)["RUNGS"] == ((16, 2), (16, 1))   # a chunk set: its steps


def test_every_setting_the_backend_reads_keys_its_launch_plans():
    """A ``FIBATTN_TRITON_*`` read anywhere in the backend is in ``SETTINGS``, which the cached launch plans are
    keyed on: a changed setting takes effect at the next call, never a stale plan."""
    import inspect
    import re
    read = set(re.findall(r'"(FIBATTN_TRITON_[A-Z_]+)"', inspect.getsource(triton_config)
                          + inspect.getsource(triton_backend)))
    assert read == set(triton_config.SETTINGS)


def test_a_choice_is_asked_once_per_plan_with_the_kernels_constexprs():
    """``triton_config._chosen``: the chooser (``triton_occupancy.choose`` on CUDA) gets the kernel, the key, the
    candidates and the constexprs a launch passes (documents or ``OFF=None``; the unchecked launch, ``CHECK``
    False; every constexpr of the kernel but the chosen ones, so that what is compiled is what is launched), and a
    plan remembers its answer and the launch options it comes with (a register cap)."""
    import inspect
    calls = []

    def choose(kernel, key, candidates, consts):
        calls.append((kernel.__name__, key, candidates, consts))
        return candidates[-1], ({"maxnreg": 168} if kernel.__name__ == "bwd_dq_kernel" else {})
    cfg = triton_config.config(4, 64, 12)
    cfg.pop("num_warps"), cfg.pop("num_stages")
    dims = dict(ACC="acc", IN="in", DOT="dot", DH=64, WIDE=False, **cfg, choose=choose)
    fwd, dq, dkdv = triton_config.forward_tiles, triton_config.query_pass_rungs, triton_config.key_pass_rungs
    assert fwd(dims, True, True) == fwd(dims, True, True) == {"BLOCK_N": 16, "MC": 16, "RB": 1}
    assert dq(dims, True, False, True) == dq(dims, True) == {"MC": 16, "RB": 1, "maxnreg": 168}
    assert dkdv(dims, False) == dkdv(dims, True, True) == {"RBK": 1, "PRODUCTS": 0}
    rungs, key = ((4, 4), (16, 2), (16, 1)), ((2, 1), (2, 0), (1, 1), (1, 0))
    assert [(n, k, c) for n, k, c, _ in calls] == [
        ("fwd_kernel", ("BLOCK_N", "MC", "RB"), tuple((bn, *r) for r in rungs for bn in (32, 16))),
        ("bwd_dq_kernel", ("MC", "RB"), rungs), ("bwd_dkdv_kernel", ("RBK", "PRODUCTS"), key),
        ("bwd_dkdv_kernel", ("RBK", "PRODUCTS"), key)]
    fwd_consts, dq_consts, key_consts = calls[0][3], calls[1][3], calls[2][3]
    assert fwd_consts["TWO_TAP"] and fwd_consts["HAS_DOCS"] and "OFF" not in fwd_consts
    assert fwd_consts["CHECK"] is False and dq_consts["CHECK"] is False and key_consts["CHECK"] is False
    assert dq_consts["NEED_DFRAC"] and not dq_consts["HAS_DOCS"] and dq_consts["OFF"] is None
    assert not key_consts["TWO_TAP"] and calls[3][3]["TWO_TAP"] and calls[3][3]["HAS_DOCS"]
    assert key_consts["KEYS"] == 16 and calls[3][3]["KEYS"] == 15            # triton_config.key_pass_rows
    kern = triton_backend.kernels()
    for name, key, _, consts in calls:
        fn = getattr(kern, name)
        chosen = set(key) if isinstance(key, tuple) else {key}
        params = inspect.signature(fn.fn).parameters.values()          # a JITFunction or the interpreter's
        assert set(consts) | chosen == {p.name for p in params if "constexpr" in str(p.annotation)} | (
            {"OFF"} & set(consts))
        assert set(consts) <= set(fn.arg_names) and consts["ACC"] == "acc"
    assert fwd(dims, False, True) == {"BLOCK_N": 32, "MC": 16, "RB": 1} and len(calls) == 5


def test_launch_plan_chooses_only_where_code_is_compiled_for_a_device():
    """No chooser for the interpreter's CPU tensors, nor for CUDA tensors traced on a machine without a device."""
    q = torch.zeros(1, 4, 8, 64)
    assert "choose" not in triton_backend._launch(q, 1, 12)[1]
    if not torch.cuda.is_available():
        assert triton_backend._target(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_recompile_when_only_length_changes():
    """T is a runtime argument: one compiled kernel serves every length."""
    kern = triton_backend.kernels()
    counts = []
    for T in (1000, 1001, 1024, 2049, 4096):
        q, k, v, dout = make(B=1, H=4, Hkv=2, T=T, Dh=64, dtype=torch.bfloat16, device="cuda")
        run(sparse(attended_distances(12, 1.5, "fib", 4096), "triton"), q, k, v, dout)
        counts.append(sum(len(c[0]) for c in kern.fwd_kernel.device_caches.values()))
    assert counts == [counts[0]] * len(counts), counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda():
    assert fibattn.ops.resolve_backend("auto", torch.device("cuda")) == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tile_choices_are_made_on_the_device(caplog):
    """On CUDA the query pass's rung chunk and step come from the compiled registers (``triton_occupancy``),
    logged once, and the op still matches the reference."""
    import logging

    from fibattn.ops import triton_occupancy
    triton_occupancy._choose.cache_clear()
    triton_backend._launch_plan.cache_clear()
    q, k, v, dout = make(B=1, H=8, Hkv=2, T=300, Dh=64, dtype=torch.float32, device="cuda")
    a = torch.tensor(1.5, device="cuda")
    with caplog.at_level(logging.INFO, logger="fibattn"):
        close(run(interp(12, "fib:15", "triton"), q, k, v, dout, a),
              run(interp(12, "fib:15", "reference"), q, k, v, dout, a), **FP32)
    assert "bwd_dq_kernel MC,RB=" in caplog.text and "not chosen by registers" not in caplog.text
