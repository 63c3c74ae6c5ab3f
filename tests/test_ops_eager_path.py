"""The public ops' eager path (``ops.eager``): the kernel set called without the custom-op
dispatch, bit for bit what the custom ops give; the custom ops still serve tracing
(``torch.compile``, ``torch.func``, ``vmap``, dispatch modes). Speed is for the benchmark:
the overhead measurement is only checked to return numbers."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fibattn
from fibattn.bench import attention as ba
from fibattn.ops import backends, cpu_backend, custom_ops, eager

from op_helpers import interp, make, run, sparse

HOST = ["cpu", "torch"]
DISTS = [0, 1, 2, 5, 9, 40]


@pytest.fixture
def one_thread():
    """Bit-for-bit comparisons run the cpu kernels on one thread: on more, their d alpha adds the
    threads' partial sums in whichever order the threads finish (run to run, not path to path)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _custom_op_path(monkeypatch):
    monkeypatch.setattr(eager, "eligible", lambda *tensors: False)


class CustomOpCalled(Exception):
    pass


def _no_custom_ops(monkeypatch):
    """Any use of the custom ops (or of their kernel-set lookup) raises CustomOpCalled."""
    def refuse(*args, **kwargs):
        raise CustomOpCalled
    for name in ("sparse_op", "sparse_backward_op", "interpolated_op", "interpolated_backward_op", "kernel_set"):
        monkeypatch.setattr(custom_ops, name, refuse)


def _cases(backend):
    return [(sparse(DISTS, backend), None), (interp(3, "fib:9", backend), torch.tensor(1.3)),
            (interp(2, [1, 3, 4, 7], backend, scale=0.4, reach=20), torch.tensor(0.7, dtype=torch.float64))]


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("dtype,noncontig", [(torch.float32, True), (torch.float64, False), (torch.bfloat16, False)])
def test_eager_and_custom_op_paths_are_bit_identical(monkeypatch, one_thread, backend, dtype, noncontig):
    q, k, v, dout = make(B=2, H=4, Hkv=2, T=29, Dh=8, dtype=dtype, noncontig=noncontig, seed=5)
    for fn, alpha in _cases(backend):
        with monkeypatch.context() as m:
            _no_custom_ops(m)
            got = run(fn, q, k, v, dout, alpha)
        with monkeypatch.context() as m:
            _custom_op_path(m)
            want = run(fn, q, k, v, dout, alpha)
        assert len(got) == len(want) == (4 if alpha is None else 5)
        for name, a, b in zip(("out", "dq", "dk", "dv", "dalpha"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("backend", HOST)
def test_eager_path_without_grad_and_with_a_float_alpha(monkeypatch, one_thread, backend):
    q, k, v, dout = make(T=17, seed=6)
    fixed = interp(2, "fib", backend)

    def float_alpha(q, k, v):
        return fixed(q, k, v, 1.3)
    with monkeypatch.context() as m:
        _no_custom_ops(m)
        with torch.no_grad():
            out = fibattn.sparse_attention(q.clone().requires_grad_(), k, v, DISTS, backend=backend)
        got = run(float_alpha, q, k, v, dout)
    assert out.grad_fn is None and not out.requires_grad
    _custom_op_path(monkeypatch)
    assert torch.equal(fibattn.sparse_attention(q, k, v, DISTS, backend=backend), out)
    assert all(torch.equal(a, b) for a, b in zip(got, run(float_alpha, q, k, v, dout)))


def test_eager_path_resolves_once_and_plans_once(monkeypatch):
    """One backend resolution per call, one column plan per forward+backward (kept on the ctx)."""
    calls = {"resolve": 0, "plan": 0}

    def counting(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(fibattn.ops, "resolve_backend", counting("resolve", fibattn.ops.resolve_backend))
    monkeypatch.setattr(cpu_backend, "plan", counting("plan", cpu_backend.plan))
    _no_custom_ops(monkeypatch)
    q, k, v, dout = make(T=12, seed=7)
    run(interp(3, "fib", "cpu"), q, k, v, dout, torch.tensor(1.2))
    assert calls == {"resolve": 1, "plan": 1}


def test_second_derivative_raises_on_the_eager_path(monkeypatch):
    _no_custom_ops(monkeypatch)
    q, k, v, _ = make(T=10, dtype=torch.float64)
    q.requires_grad_()
    a = torch.tensor(1.4, dtype=torch.float64, requires_grad=True)
    out = fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=2, backend="torch")
    dq, da = torch.autograd.grad(out.square().sum(), (q, a), create_graph=True)
    with pytest.raises(RuntimeError, match="interpolated_sparse_attention has no second derivative"):
        (dq.sum() + da).backward()


# ----------------------------------------------------------------------------- tracing keeps the custom ops
@pytest.mark.parametrize("backend", HOST)
def test_eager_runs_without_custom_ops_but_func_grad_and_vmap_use_them(monkeypatch, backend):
    q, k, v, dout = make(T=14, seed=8)
    _no_custom_ops(monkeypatch)
    run(sparse(DISTS, backend), q, k, v, dout)                     # eager: the custom op is never called
    run(interp(3, "fib", backend), q, k, v, dout, torch.tensor(1.1))
    with pytest.raises(CustomOpCalled):
        torch.func.grad(lambda q: fibattn.sparse_attention(q, k, v, DISTS, backend=backend).sum())(q)
    with pytest.raises(CustomOpCalled):
        torch.vmap(lambda q: fibattn.interpolated_sparse_attention(q, k, v, alpha=1.2, base="fib", window=3,
                                                                   backend=backend))(q[None])


def test_torch_compile_traces_the_custom_ops():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    q, k, v, _ = make(B=1, H=2, Hkv=2, T=8, seed=9)
    a = torch.tensor(1.3, requires_grad=True)

    def f(q, k, v, a):
        return (fibattn.sparse_attention(q, k, v, DISTS, backend="cpu")
                + fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=2, backend="cpu"))
    want = f(q, k, v, a)
    got = torch.compile(f, backend=record, fullgraph=True)(q, k, v, a)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    code = "\n".join(m.code for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    assert "fibattn.sparse_attention" in code and "fibattn.interpolated_sparse_attention" in code


def test_dispatch_modes_see_the_custom_op():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, _ = make(T=8, seed=10)
    assert eager.eligible(q, k, v)
    with Record():
        assert not eager.eligible(q, k, v)
        fibattn.sparse_attention(q, k, v, DISTS, backend="cpu")           # no backward can follow: no state
        fibattn.sparse_attention(q.requires_grad_(), k, v, DISTS, backend="cpu")
    n = custom_ops.SAVED_STATE_VERSION
    assert [f for f in seen if f.startswith("fibattn.")] == [f"fibattn.sparse_attention_forward_v{n}.default",
                                                             f"fibattn.sparse_attention_v{n}.default"]


def test_auto_backend_on_the_eager_path_logs_its_pick_once(monkeypatch, caplog):
    monkeypatch.setattr(backends, "_auto_logged", set())
    _no_custom_ops(monkeypatch)
    q, k, v, _ = make(T=4)
    with caplog.at_level("INFO", logger="fibattn"):
        for _ in range(2):
            fibattn.interpolated_sparse_attention(q, k, v, alpha=1.0, base="fib", window=1)
    assert [r.getMessage() for r in caplog.records if "backend auto" in r.getMessage()] == \
        ["fibattn: backend auto -> cpu on cpu"]


# ----------------------------------------------------------------------------- the overhead measurement
@pytest.mark.parametrize("op", ["integer", "interpolated"])
def test_host_overhead_returns_numbers(op):
    res = ba.host_overhead(op, seconds=0.01, calls=2)
    assert res.op == op
    for x in (res.public_us, res.direct_us, res.overhead_us, res.autograd_us, res.fibattn_us):
        assert isinstance(x, float) and math.isfinite(x)
    assert res.public_us > 0 and res.direct_us > 0
    assert res.line().startswith(f"host overhead per call (cpu, T=16, fwd+bwd, {op}): public op ")
    # cold: each call after twice the largest cache is written; at least three rounds however short the time
    cold = ba.host_overhead(op, seconds=0.0, cold=True)
    assert cold.cold and cold.public_us > 0 and cold.direct_us > 0 and math.isfinite(cold.fibattn_us)
    assert cold.line().startswith(f"host overhead per call (cpu, T=16, fwd+bwd, {op}, caches emptied first): ")
    with pytest.raises(ValueError, match="op must be"):
        ba.host_overhead("dense")
