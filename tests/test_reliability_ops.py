"""The public ops on hostile input (issue 58, kinds 2-5): ids edited in place between calls, sizes that must be
capped by the sequence length, edge inputs, and refusals that must hold under ``torch.compile`` too.

Each kind is held across backends and both ops: a value either works the same everywhere or is refused in one
line (a UsageError) naming the argument; nothing is derived from ``document_ids`` between calls.
"""
import zlib

import numpy as np
import pytest
import torch

import fibattn
from fibattn.checks import UsageError
from fibattn.ops import (backend_available, document_ids_from_cu_seqlens, document_ids_from_eos,
                         document_ids_from_position_ids)

BACKENDS = ["reference", "torch", "cpu"] + (
    ["triton"] if backend_available("triton", torch.device("cpu")) is None else [])
DISTS = [0, 1, 2, 5, 9]


def _qkv(B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 2, T, 4, generator=g), torch.randn(B, 1, T, 4, generator=g),
            torch.randn(B, 1, T, 4, generator=g))


def _op(kind, backend, **kw):
    if kind == "integer":
        return lambda q, k, v, **more: fibattn.sparse_attention(q, k, v, kw.get("dists", DISTS), backend=backend,
                                                                **more)
    return lambda q, k, v, **more: fibattn.interpolated_sparse_attention(
        q, k, v, alpha=kw.get("alpha", 1.37), base=kw.get("base", "fib"), window=kw.get("window", 2),
        reach=kw.get("reach"), backend=backend, **more)


# ----------------------------------------------------------------------------- kind 2: ids changed in place
def _refill(kind: str, ids: torch.Tensor, new: torch.Tensor) -> None:
    """Write ``new`` into ``ids``' storage the ways a data loader may (some of them leave its version alone)."""
    if kind == "numpy":
        ids.numpy()[...] = new.numpy()
    elif kind == "data":
        ids.data[...] = new
    elif kind == "shared":                                 # another tensor over the same (shared) memory
        alias = torch.empty(0, dtype=ids.dtype).set_(ids.untyped_storage(), 0, ids.shape, ids.stride())
        alias.copy_(new)
    elif kind == "no_grad":
        with torch.no_grad():
            ids[...] = new
    else:
        ids.copy_(new)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["integer", "interpolated"])
@pytest.mark.parametrize("how", ["numpy", "data", "shared", "no_grad", "copy_"])
def test_document_ids_changed_in_place_are_seen_by_the_next_call(backend, op, how):
    q, k, v = _qkv()
    f = _op(op, backend)
    first = torch.tensor([[0] * 6 + [1] * 6, [0] * 12])
    second = torch.tensor([[0] * 3 + [1] * 9, [0] * 4 + [1] * 4 + [2] * 4])
    ids = first.clone()
    if how == "shared":
        ids.share_memory_()
    before = f(q, k, v, document_ids=ids)
    torch.testing.assert_close(before, f(q, k, v, document_ids=first.clone()), rtol=0, atol=0)
    _refill(how, ids, second)
    torch.testing.assert_close(f(q, k, v, document_ids=ids), f(q, k, v, document_ids=second.clone()), rtol=0, atol=0)
    assert not torch.equal(before, f(q, k, v, document_ids=ids))        # the change mattered
    # a document split into two runs written in place is refused like a fresh tensor would be
    _refill(how, ids, torch.tensor([[0] * 3 + [1] * 3 + [0] * 6, [0] * 12]))
    with pytest.raises(UsageError, match="row 0: document 0 appears in more than one run"):
        f(q, k, v, document_ids=ids)


# ----------------------------------------------------------------------------- kind 3: sizes capped by T
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_far_beyond_the_length_attends_what_a_window_of_t_minus_one_does(backend):
    q, k, v = _qkv(T=10)
    want = _op("interpolated", backend, window=9)(q, k, v)
    for window in (10, 10 ** 12, 2 ** 70, np.int64(2 ** 62)):
        torch.testing.assert_close(_op("interpolated", backend, window=window)(q, k, v), want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_distances_of_any_size_cost_nothing(backend):
    q, k, v = _qkv(T=10)
    want = _op("integer", backend, dists=[0, 1, 5])(q, k, v)
    got = _op("integer", backend, dists=[0, 1, 5, 10, 10 ** 15, 2 ** 70, 2 ** 200])(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_helpers_refuse_sizes_that_cannot_fit_before_allocating():
    with pytest.raises(UsageError, match="total .* needs at least"):
        document_ids_from_cu_seqlens([0, 3, 5], total=10 ** 13)
    with pytest.raises(UsageError, match="base k must be at most 91"):
        fibattn.interpolated_sparse_attention(*_qkv(), alpha=1.3, base="fib:100000000", window=2)


# ----------------------------------------------------------------------------- kind 4: edge inputs
@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_numbers_and_arrays_work_as_python_ones(backend):
    q, k, v = _qkv()
    torch.testing.assert_close(_op("integer", backend, dists=np.array(DISTS))(q, k, v),
                               _op("integer", backend)(q, k, v), rtol=0, atol=0)
    torch.testing.assert_close(_op("integer", backend, dists=[np.int64(d) for d in DISTS])(q, k, v),
                               _op("integer", backend)(q, k, v), rtol=0, atol=0)
    want = _op("interpolated", backend, window=2, reach=9, base=[1, 2, 3, 5])(q, k, v)
    got = _op("interpolated", backend, window=np.int32(2), reach=np.int64(9), base=np.array([1, 2, 3, 5]),
              alpha=np.float64(1.37))(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["integer", "interpolated"])
def test_empty_batches_heads_and_lengths_give_empty_outputs_and_gradients(backend, op):
    for B, T in ((0, 12), (2, 0), (0, 0)):
        q, k, v = (x.requires_grad_() for x in _qkv(B=B, T=T))
        out = _op(op, backend)(q, k, v, document_ids=torch.zeros(B, T, dtype=torch.long))
        assert out.shape == q.shape
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


BAD = [  # (argument, what the call passes): each refused in one line naming the argument
    ("distances", dict(dists=[0, True])), ("distances", dict(dists=[0, "1"])), ("distances", dict(dists=5)),
    ("distances", dict(dists=[0, -1])), ("distances", dict(dists=[0, 1.5])),
    ("window", dict(window=True)), ("window", dict(window="2")), ("window", dict(window=-1)),
    ("reach", dict(reach=0)), ("reach", dict(reach=2.5)),
    ("alpha", dict(alpha=True)), ("alpha", dict(alpha="1.3")), ("alpha", dict(alpha=2 ** 2000)),
    ("alpha", dict(alpha=torch.tensor(True))), ("alpha", dict(alpha=float("nan"))),
    ("base values", dict(base=[1, 2 ** 70])), ("base values", dict(base=[1, True])), ("base k", dict(base="fib:x")),
    ("scale", dict(scale=True)), ("scale", dict(scale="0.5")), ("scale", dict(scale=2 ** 2000)),
]


@pytest.mark.parametrize("name, kw", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_scalars_are_refused_naming_the_argument(name, kw):
    q, k, v = _qkv()
    scale = kw.pop("scale", None)
    op = "integer" if "dists" in kw or scale is not None else "interpolated"
    for backend in BACKENDS:
        with pytest.raises(UsageError, match=name) as err:
            _op(op, backend, **kw)(q, k, v, **({} if scale is None else {"scale": scale}))
        assert "\n" not in str(err.value)


def test_meta_tensors_run_where_a_backend_can_and_are_refused_in_one_line_where_not():
    q, k, v = (x.to("meta") for x in _qkv())
    for backend in ("reference", "torch", "auto"):
        assert fibattn.sparse_attention(q, k, v, DISTS, backend=backend).device.type == "meta"
        assert fibattn.interpolated_sparse_attention(q, k, v, alpha=1.3, base="fib", window=2,
                                                     backend=backend).shape == q.shape
    for backend in ("cpu", "triton"):
        with pytest.raises(UsageError, match=f"backend '{backend}' cannot run on meta"):
            fibattn.sparse_attention(q, k, v, DISTS, backend=backend)


def test_the_document_id_converters_refuse_what_they_would_truncate_or_misread():
    ok = document_ids_from_cu_seqlens(np.array([0, 3, 5]), total=np.int64(7))
    assert ok.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert document_ids_from_eos(np.array([1, 2, 0, 3]), np.int64(0)).tolist() == [0, 0, 0, 1]
    assert document_ids_from_position_ids(np.array([0, 1, 0, 1])).tolist() == [[0, 0, 1, 1]]
    for call, name in [(lambda: document_ids_from_cu_seqlens([0, 3, 5], total=7.5), "total"),
                       (lambda: document_ids_from_cu_seqlens([0, 3, 5], total=True), "total"),
                       (lambda: document_ids_from_cu_seqlens([0, 2 ** 70]), "cu_seqlens"),
                       (lambda: document_ids_from_cu_seqlens("abc"), "cu_seqlens"),
                       (lambda: document_ids_from_cu_seqlens([0.0, 3.5]), "cu_seqlens"),
                       (lambda: document_ids_from_position_ids([[0, 1, -5, 0]]), "position_ids must be >= 0"),
                       (lambda: document_ids_from_position_ids([0, 2 ** 70]), "position_ids"),
                       (lambda: document_ids_from_eos(torch.tensor([1, 0]), 2 ** 70), "eos"),
                       (lambda: document_ids_from_eos(torch.tensor([1, 0]), "0"), "eos"),
                       (lambda: document_ids_from_eos(torch.tensor([1, 0]), True), "eos")]:
        with pytest.raises(UsageError, match=name):
            call()


# ----------------------------------------------------------------------------- kind 5: refusals when compiled
def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("op", ["integer", "interpolated"])
def test_a_split_document_is_refused_when_compiled_too(op):
    q, k, v = _qkv()
    f = _compiled(lambda q, k, v, ids: _op(op, "auto")(q, k, v, document_ids=ids))
    good = torch.tensor([[0] * 6 + [1] * 6, [0] * 12])
    torch.testing.assert_close(f(q, k, v, good), _op(op, "auto")(q, k, v, document_ids=good))
    with pytest.raises(RuntimeError, match="appears in more than one run"):
        f(q, k, v, torch.tensor([[0] * 3 + [1] * 3 + [0] * 6, [0] * 12]))


def test_a_bad_alpha_tensor_is_refused_when_compiled_too():
    q, k, v = _qkv()
    f = _compiled(lambda q, k, v, a: fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=2))
    f(q, k, v, torch.tensor(1.3))
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="alpha must be a finite number > 0"):
            f(q, k, v, torch.tensor(bad))


def test_token_ids_out_of_range_are_refused_by_a_compiled_model():
    from fibattn.config import ModelConfig
    from fibattn.model.lm import FibLM
    torch.manual_seed(0)
    model = FibLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=8, window=2))
    f = _compiled(model)
    f(torch.randint(0, 16, (1, 8)))
    for bad in (16, -1):
        with pytest.raises(RuntimeError, match="token ids must lie in"):
            f(torch.full((1, 8), bad))


# ----------------------------------------------------------------------------- kind 1: non-finite values
def _attended(op: str, T: int, ids, window=2, alpha=1.37) -> list[set]:
    """Per query, the key rows it reads, from the definitions (method.md §1, §3, §8): row ``i - d`` for every
    distance within the query's document; a rung reads both taps, the second clamped at the document start."""
    from fibattn.schedules import interpolation_plan
    out = []
    for i in range(T):
        start = i - next(n for n in range(i + 1) if i - n == 0 or ids[i - n - 1] != ids[i])
        here = set()
        if op == "integer":
            here |= {i - d for d in DISTS if i - d >= start}
        else:
            plan = interpolation_plan(window, alpha, "fib", T)
            here |= {i - d for d in plan.window if i - d >= start}
            for lo, _ in plan.rungs:
                if i - lo >= start:
                    here |= {i - lo, max(i - lo - 1, start)}
        out.append(here)
    return out


def _grads(op, backend, q, k, v, dout, ids):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    alpha = torch.tensor(1.37, dtype=torch.float64, requires_grad=True)
    if op == "integer":
        out = fibattn.sparse_attention(*leaves, DISTS, backend=backend, document_ids=ids)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout), None]
    out = fibattn.interpolated_sparse_attention(*leaves, alpha=alpha, base="fib", window=2, backend=backend,
                                                document_ids=ids)
    return [out.detach(), *torch.autograd.grad(out, leaves + [alpha], dout)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["integer", "interpolated"])
def test_a_non_finite_value_reaches_only_the_queries_that_read_it(backend, op):
    """For random documents and a NaN / inf / -inf at a random place of q, k, v or dout: the output and dq of
    every query that does not read it, dk / dv of every row no such query reads, and d alpha when no reader
    has a rung, equal the clean run's (and are finite)."""
    _non_finite_stays_with_its_readers(backend, op, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["integer", "interpolated"])
def test_a_non_finite_value_reaches_only_its_readers_on_the_gpu(op):
    """The same on CUDA tensors: the Triton kernels as the device runs them (tensor-core products included)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _non_finite_stays_with_its_readers("triton", op, "cuda")


def _non_finite_stays_with_its_readers(backend, op, device):
    rng = np.random.default_rng(zlib.crc32(f"{backend}-{op}".encode()))
    T, B = 40, 1
    for trial in range(8):
        cuts = sorted(rng.choice(np.arange(1, T), size=int(rng.integers(0, 4)), replace=False).tolist())
        ids_list = [sum(i >= c for c in cuts) for i in range(T)]
        ids = torch.tensor([ids_list]) if trial % 2 else None
        seen = _attended(op, T, ids_list if ids is not None else [0] * T)
        q, k, v = (x.to(device) for x in _qkv(B=B, T=T, seed=trial))
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(trial + 10)).to(device)
        ids = None if ids is None else ids.to(device)
        clean = _grads(op, backend, q, k, v, dout, ids)
        where, row = ["q", "k", "v", "dout"][trial % 4], int(rng.integers(0, T))
        inputs = dict(q=q.clone(), k=k.clone(), v=v.clone(), dout=dout.clone())
        inputs[where][0, 0, row, int(rng.integers(0, 4))] = [float("nan"), float("inf"), float("-inf")][trial % 3]
        got = _grads(op, backend, inputs["q"], inputs["k"], inputs["v"], inputs["dout"], ids)
        # the queries the bad value reaches: its reader(s) for k / v, itself for q and dout (head 0; k/v head 0
        # serves both query heads)
        readers = {i for i in range(T) if row in seen[i]} if where in ("k", "v") else {row}
        heads = [0, 1] if where in ("k", "v") else [0]
        free_q = [i for i in range(T) if i not in readers]
        free_kv = [j for j in range(T) if not any(j in seen[i] for i in readers)]
        for name, a, b, rows in (("out", got[0], clean[0], free_q), ("dq", got[1], clean[1], free_q),
                                 ("dk", got[2], clean[2], free_kv), ("dv", got[3], clean[3], free_kv)):
            for h in (heads if name in ("out", "dq") else [0]):
                assert torch.isfinite(a[0, h, rows]).all(), (name, where, row, trial)
                torch.testing.assert_close(a[0, h, rows], b[0, h, rows], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} ({where} row {row}, trial {trial}): {m}")
        # and the readers do see it (what the arithmetic makes non-finite whatever the backend: a NaN key or
        # value reaches its readers' outputs and dq; a bad dout its query's dq and the rows that query reads)
        hit = sorted(readers)
        read = sorted(set().union(*(seen[i] for i in readers)))
        must = {"dout": [("dq", got[1], hit), ("dk", got[2], read), ("dv", got[3], read)]}.get(
            where, [("out", got[0], hit), ("dq", got[1], hit)] if trial % 3 == 0 and where != "q" else [])
        for name, a, rows in must:
            assert (~torch.isfinite(a[0, 0, rows])).any(-1).all(), (name, where, row, trial)
        if op == "interpolated" and where != "q" and not any(seen[i] - {i - d for d in (0, 1, 2)} for i in readers):
            torch.testing.assert_close(got[4], clean[4], msg=lambda m: f"d alpha ({where} row {row}, {trial}): {m}")


def test_flex_forward_keeps_a_non_finite_value_to_its_readers():
    pytest.importorskip("torch.nn.attention.flex_attention")
    T = 40
    ids = torch.tensor([[0] * 13 + [1] * 15 + [2] * 12])
    seen = _attended("integer", T, ids[0].tolist())
    q, k, v = _qkv(B=1, T=T)
    for row, value, docs in ((39, float("nan"), None), (13, float("inf"), ids), (20, float("-inf"), ids)):
        bad_v = v.clone()
        bad_v[0, 0, row, 1] = value
        clean = fibattn.sparse_attention(q, k, v, DISTS, backend="flex", document_ids=docs)
        got = fibattn.sparse_attention(q, k, bad_v, DISTS, backend="flex", document_ids=docs)
        look = seen if docs is not None else _attended("integer", T, [0] * T)
        free = [i for i in range(T) if row not in look[i]]
        torch.testing.assert_close(got[0, :, free], clean[0, :, free])
        assert torch.isnan(got[0, :, [i for i in range(T) if row in look[i]]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_row_only_clamped_reads_touch_leaves_alpha_and_the_other_documents_alone(backend):
    """A NaN at the start of a document too short for any rung: rows before a rung's reach read that start row
    clamped (where the rung does not exist), which must not reach d alpha or any other query."""
    T = 40
    ids = torch.tensor([[0] * 3 + [1] * 37])
    q, k, v = _qkv(B=1, T=T, seed=5)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    clean = _grads("interpolated", backend, q, k, v, dout, ids)
    for where in ("k", "v"):
        bad = dict(k=k.clone(), v=v.clone())
        bad[where][0, 0, 0, 2] = float("nan")
        got = _grads("interpolated", backend, q, bad["k"], bad["v"], dout, ids)
        torch.testing.assert_close(got[4], clean[4])                  # queries 0-2 read row 0 through the window
        for a, b in zip(got[:4], clean[:4]):
            torch.testing.assert_close(a[..., 3:, :], b[..., 3:, :])  # the other document
