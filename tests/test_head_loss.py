"""The loss heads (``fibattn.model.head_loss``, ``train.loss_head``) against the plain one: the loss and both
gradients (hidden states, head weight), odd row counts and chunk sizes, ignored targets, fp64 gradients
against finite differences, bf16 autocast, under ``torch.compile(fullgraph=True)``, through the model and
through training. liger-kernel runs here in Triton's interpreter (tests/conftest.py sets it)."""
import pytest
import torch

from fibattn.checks import UsageError
from fibattn.config import ConfigError
from fibattn.model.head_loss import ChunkedLinearCrossEntropy, chunk_rows, head_loss, liger_available
from fibattn.model.lm import FibLM
from fibattn.presets import tiny
from fibattn.trainer.setup import loss_head_for
from fibattn.trainer.trainer import train
from run_helpers import micro_config

needs_liger = pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")
HEADS = ["chunked", pytest.param("liger", marks=needs_liger)]


def _case(n, c=16, v=50, dtype=torch.float32, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, c, generator=g, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[list(ignored)] = -100
    return h, w, t


def _run(how, h, w, t, chunk=None, fn=head_loss):
    h.grad = w.grad = None
    loss = fn(h, w, t, how, chunk)
    (loss * 1.7).backward()                 # a gradient other than 1 reaches the head
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("how", HEADS)
@pytest.mark.parametrize("n,chunk,ignored", [(1, None, ()), (97, 64, (0, 40, 96)), (1025, 64, (5,)),
                                             (130, 1, ()), (64, 64, tuple(range(0, 64, 2)))])
def test_heads_equal_the_plain_head(how, n, chunk, ignored):
    h, w, t = _case(n, ignored=ignored)
    want = _run("plain", h, w, t)
    got = _run(how, h, w, t, chunk)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_target_ignored_gives_nan_as_plain():
    """0 / 0, as ``F.cross_entropy`` (liger-kernel returns 0 there instead)."""
    h, w, t = _case(8, ignored=range(8))
    assert torch.isnan(head_loss(h, w, t, "chunked")) and torch.isnan(head_loss(h, w, t, "plain"))


def test_chunked_gradients_match_finite_differences_fp64():
    h, w, t = _case(13, c=5, v=7, dtype=torch.float64, ignored=(2,))
    assert torch.autograd.gradcheck(lambda a, b: ChunkedLinearCrossEntropy.apply(a, b, t, 4) * 3.0, (h, w))


def test_chunked_under_bf16_autocast_is_within_bf16_of_plain():
    h, w, t = _case(200, c=32, v=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = _run("plain", h, w, t), _run("chunked", h, w, t, 64)
    assert got[1].dtype == h.dtype and got[2].dtype == w.dtype
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("how", HEADS)
def test_heads_trace_whole_under_compile(how):
    """fullgraph: the chunked head is traced (its loop unrolled), liger's stays one custom op."""
    torch._dynamo.reset()
    h, w, t = _case(97, ignored=(3,))
    compiled = torch.compile(head_loss, fullgraph=True, backend="aot_eager")
    want, got = _run("plain", h, w, t), _run(how, h, w, t, 32, fn=compiled)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunk_rows_bound_the_logits():
    assert chunk_rows(32768) == 2048 and chunk_rows(50) % 64 == 0 and chunk_rows(10 ** 9) == 64


@pytest.mark.parametrize("how", HEADS)
@pytest.mark.parametrize("tied", [True, False])
def test_model_loss_without_logits_equals_forward(how, tied):
    """``FibLM.forward(x, y, return_logits=False)`` gives no logits and the plain forward's loss and gradients
    for every parameter (tied or untied head)."""
    cfg = tiny().model
    cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.seq_len, cfg.backend = 2, 32, 2, 1, 32, "torch"
    cfg.tie_embeddings = tied
    torch.manual_seed(0)
    model = FibLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    y = torch.roll(x, -1, 1)
    y[0, -1] = -100

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want = grads(model(x, y)[1])
    logits, loss = model.set_loss_head(how)(x, y, return_logits=False)
    assert logits is None
    got = grads(loss)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_bad_loss_heads_are_refused(monkeypatch):
    with pytest.raises(UsageError, match="loss head must be one of plain, chunked, liger, got 'fast'"):
        FibLM(tiny().model).set_loss_head("fast")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="train.loss_head=liger runs on CUDA"):
        loss_head_for("liger", torch.device("cpu"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loss_head_for("auto", cpu) == "plain" and loss_head_for("auto", cuda) == "chunked"
    assert loss_head_for("chunked", cpu) == "chunked"


def test_liger_without_the_package_names_the_install(monkeypatch):
    import importlib.util
    from fibattn import validation as V
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name))
    cfg = micro_config("o", "d", loss_head="liger")
    with pytest.raises(ConfigError, match="pip install liger-kernel"):
        V.validate(cfg)


def test_training_with_the_chunked_head_follows_the_plain_one(tmp_path, tiny_data):
    """Six steps with each head from the same start: the losses agree to fp32 rounding (the sums run in
    another order), and the run says which head it used."""
    losses = {}
    for how in ("plain", "chunked"):
        cfg = micro_config(tmp_path / how, tiny_data, n_layers=2, steps=6, batch_tokens=128, micro_batch=2,
                           eval_tokens=64, threads=1, results_db="off", loss_head=how)
        losses[how] = [v for _, v in train(cfg).losses]
    torch.testing.assert_close(losses["chunked"], losses["plain"], rtol=1e-5, atol=1e-5)
