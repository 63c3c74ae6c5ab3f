"""The ops under the compiler and functorch: custom-op checks, a full-graph compiled FibLM
(static and learned alpha) against eager, ``torch.func.grad`` and ``torch.vmap``."""
import pytest
import torch

import fibattn
from fibattn.config import ModelConfig
from fibattn.model.lm import FibLM
from fibattn.ops import backend_available, custom_ops
from fibattn.ops.documents import offsets_unchecked

HOST = ["torch", "cpu"]
TRITON_CPU = pytest.param("triton", marks=pytest.mark.skipif(
    backend_available("triton", torch.device("cpu")) is not None, reason="triton interpreter unavailable"))


def _qkv(T=33, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, T, 8, generator=g, dtype=dtype, requires_grad=True) for h in (4, 2, 2)]


@pytest.mark.parametrize("backend,packed", [(b, p) for b in HOST for p in (False, True)] + [
    pytest.param("triton", False, marks=TRITON_CPU.marks),
    pytest.param("triton", True, marks=[pytest.mark.slow, *TRITON_CPU.marks])])
def test_opcheck(backend, packed):
    """Schema, fake (meta) implementations with dynamic shapes, and autograd registration; one document
    per row, and packed documents."""
    q, k, v = _qkv(T=20 if backend == "triton" else 33)
    a = torch.tensor(1.3, requires_grad=True)
    T = q.shape[2]
    docs = torch.tensor([[0] * 7 + [1] * (T - 7), [0] * 2 + [1] * 12 + [2] * (T - 14)])
    for off in ((offsets_unchecked(docs),) if packed else (None,)):
        res = torch.library.opcheck(custom_ops.sparse_op, (q, k, v, [0, 1, 2, 5, 40], 0.3, backend, off))
        assert set(res.values()) == {"SUCCESS"}, res
        res = torch.library.opcheck(custom_ops.interpolated_op,
                                    (q, k, v, a, 3, [1, 2, 3, 5, 8, 13], None, 0.3, backend, off))
        assert set(res.values()) == {"SUCCESS"}, res
        bare = [x.detach() for x in (q, k, v, a)]             # the forward-only ops: nothing to differentiate
        res = torch.library.opcheck(custom_ops.sparse_forward_op, (*bare[:3], [0, 1, 2, 5, 40], 0.3, backend, off))
        assert set(res.values()) == {"SUCCESS"}, res
        res = torch.library.opcheck(custom_ops.interpolated_forward_op,
                                    (*bare, 3, [1, 2, 3, 5, 8, 13], None, 0.3, backend, off))
        assert set(res.values()) == {"SUCCESS"}, res


# Each kernel set's saved state (aux) for q (2, 4, 33, 8) at custom_ops.SAVED_STATE_VERSION: an op's
# name carries the version, so a compiled graph cached on disk under another layout is never reused.
SAVED_STATES = {2: {("torch", False): (2, 4, 33, 5), ("torch", True): (2, 4, 33, 10),
                    ("cpu", False): (2, 4, 33, 5), ("cpu", True): (2, 4, 66, 10),
                    ("triton", False): (2, 4, 33), ("triton", True): (2, 4, 33)}}


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_saved_state_layouts_are_those_of_the_ops_version(backend):
    """A changed ``aux`` layout fails here until SAVED_STATE_VERSION (and so every op's name) changes:
    torch.compile keys its on-disk cache by the graph's code, not by the ops' fake implementations."""
    if backend == "triton":
        pytest.importorskip("triton")
    from fibattn.ops.backends import kernels
    from fibattn.ops.columns import ColumnSpec
    q = torch.zeros(2, 4, 33, 8)
    specs = {False: ColumnSpec((0, 1, 2, 5, 40)), True: ColumnSpec(None, 3, (1, 2, 3, 5, 8, 13), None)}
    pinned = SAVED_STATES.get(custom_ops.SAVED_STATE_VERSION)
    assert pinned is not None, f"pin the saved states of version {custom_ops.SAVED_STATE_VERSION} here"
    for interpolated, spec in specs.items():
        got = tuple(kernels(backend).aux_like(q, spec).shape)
        assert got == pinned[backend, interpolated], (
            f"{backend}'s saved state changed to {got}: bump custom_ops.SAVED_STATE_VERSION and pin it here")
    assert str(custom_ops.sparse_op._name).endswith(f"_v{custom_ops.SAVED_STATE_VERSION}")
    assert str(custom_ops.interpolated_backward_op._name).endswith(f"_v{custom_ops.SAVED_STATE_VERSION}")


def _tiny(schedule, backend="auto"):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, window=4,
                      schedule=schedule, backend=backend)
    torch.manual_seed(0)
    return FibLM(cfg)


def _loss_and_grads(fn, model, idx, tgt):
    model.zero_grad(set_to_none=True)
    _, loss = fn(idx, tgt)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("schedule", ["linear", pytest.param("learned", marks=pytest.mark.slow)])
def test_fullgraph_compiled_fiblm_matches_eager(schedule):
    """Inductor on CPU, ``fullgraph=True``: no graph break anywhere, a learned alpha included."""
    torch._dynamo.reset()
    model = _tiny(schedule)
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, 64, (2, 32), generator=g) for _ in range(2))
    want_loss, want = _loss_and_grads(model, model, idx, tgt)
    compiled = torch.compile(model, fullgraph=True)
    got_loss, got = _loss_and_grads(compiled, model, idx, tgt)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if schedule == "learned":
        assert all(layer.alphas.theta.grad.abs().item() > 0 for layer in model.layers())


def test_fullgraph_compiled_triton_backend():
    """The triton custom ops traced by the compiler (kernels in the interpreter on CPU)."""
    if backend_available("triton", torch.device("cpu")) is not None:
        pytest.skip("triton interpreter unavailable")
    torch._dynamo.reset()
    model = _tiny("learned", backend="triton")
    idx = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(2))
    want_loss, want = _loss_and_grads(model, model, idx, idx)
    got_loss, got = _loss_and_grads(torch.compile(model, fullgraph=True, backend="aot_eager"), model, idx, idx)
    torch.testing.assert_close(got_loss, want_loss)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", HOST)
def test_func_grad_and_vmap_per_sample(backend):
    """``vmap(grad(...))``: per-sample gradients of q and of alpha, each equal to its own autograd."""
    g = torch.Generator().manual_seed(3)
    n = 3
    q = torch.randn(n, 2, 4, 25, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, 2, 2, 25, 8, generator=g, dtype=torch.float64) for _ in range(2))
    a = torch.tensor(1.3, dtype=torch.float64)

    def loss(q, k, v, a):
        out = fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib:9", window=3, backend=backend)
        return out.square().sum() + fibattn.sparse_attention(q, k, v, [0, 1, 4, 9], backend=backend).sum()

    dq, da = torch.vmap(torch.func.grad(loss, argnums=(0, 3)), in_dims=(0, 0, 0, None))(q, k, v, a)
    for i in range(n):
        qi, ai = q[i].clone().requires_grad_(), a.clone().requires_grad_()
        want_q, want_a = torch.autograd.grad(loss(qi, k[i], v[i], ai), (qi, ai))
        torch.testing.assert_close(dq[i], want_q)
        torch.testing.assert_close(da[i], want_a)
    out = torch.vmap(lambda q: fibattn.sparse_attention(q, k[0], v[0], [0, 2], backend=backend))(q)
    want = torch.stack([fibattn.sparse_attention(q[i], k[0], v[0], [0, 2], backend=backend) for i in range(n)])
    torch.testing.assert_close(out, want)


def test_double_backward_says_it_is_unsupported():
    q, k, v = _qkv(dtype=torch.float64)
    out = fibattn.sparse_attention(q, k, v, [0, 1, 3], backend="cpu")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        dq.sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("schedule", ["linear", "learned"])
def test_fullgraph_compiled_fiblm_on_cuda(schedule):
    torch._dynamo.reset()
    model = _tiny(schedule).cuda()
    idx, tgt = (torch.randint(0, 64, (2, 32), device="cuda") for _ in range(2))
    want_loss, want = _loss_and_grads(model, model, idx, tgt)
    got_loss, got = _loss_and_grads(torch.compile(model, fullgraph=True), model, idx, tgt)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_compiled_forward_without_backward_saves_no_state(monkeypatch):
    """Compiled under ``no_grad`` (or on inputs that need no gradient), both ops trace to their
    forward-only custom ops: the cpu kernels get no saved state, and out is the same bits as eager's;
    with gradients the graph keeps the op that saves it. The forward-only ops' vmap rule (folded
    batch; a mapped alpha, one call per slice) matches a loop."""
    from fibattn.ops import cpu_backend
    torch._dynamo.reset()
    q, k, v = _qkv()
    a = torch.tensor(1.3, requires_grad=True)
    ids = torch.tensor([[0] * 7 + [1] * 26, [0] * 20 + [1] * 13])

    def f(q, k, v, a):
        return (fibattn.sparse_attention(q, k, v, [0, 1, 2, 5, 40], backend="cpu", document_ids=ids)
                + fibattn.interpolated_sparse_attention(q, k, v, alpha=a, base="fib", window=3, backend="cpu"))
    codes, states = [], []

    def record(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward
    real = cpu_backend._split
    monkeypatch.setattr(cpu_backend, "_split", lambda *x: states.append(1) or real(*x))
    compiled = torch.compile(f, backend=record, fullgraph=True)
    with torch.no_grad():
        want, got = f(q, k, v, a), compiled(q, k, v, a)
    assert torch.equal(got, want) and not states
    assert "sparse_attention_forward_v" in codes[-1] and "interpolated_sparse_attention_forward_v" in codes[-1]
    bare = [x.detach() for x in (q, k, v, a)]
    assert torch.equal(compiled(*bare), want) and not states and "_forward_v" in codes[-1]
    out = compiled(q, k, v, a)                                    # gradients wanted: the state is saved
    assert states and "_forward_v" not in codes[-1] and torch.equal(out.detach(), want)
    out.sum().backward()
    assert q.grad is not None and a.grad is not None

    g = torch.Generator().manual_seed(5)
    qs, ks, vs = (torch.randn(3, *x.shape, generator=g) for x in bare[:3])
    alphas = torch.tensor([1.1, 1.3, 2.0])
    fwd = custom_ops.sparse_forward_op
    got = torch.vmap(lambda q, k: fwd(q, k, bare[2], [0, 1, 3], 0.3, "cpu", None))(qs, ks)
    torch.testing.assert_close(got, torch.stack([fwd(qs[i], ks[i], bare[2], [0, 1, 3], 0.3, "cpu", None)
                                                 for i in range(3)]), rtol=0, atol=0)
    ifwd = custom_ops.interpolated_forward_op
    args = (2, [1, 2, 3, 5, 8], None, 0.3, "cpu", None)
    got = torch.vmap(lambda q, v, a: ifwd(q, bare[1], v, a, *args))(qs, vs, alphas)
    torch.testing.assert_close(got, torch.stack([ifwd(qs[i], bare[1], vs[i], alphas[i], *args) for i in range(3)]),
                               rtol=0, atol=0)
