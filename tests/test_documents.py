"""Packed documents (method.md §8): a packed row computes exactly what each document computes on
its own — every backend, outputs and gradients (alpha too); the model, dense layers included;
training and evaluation with document masking; the converters from other stacks' conventions."""
import json

import pytest
import torch

import fibattn
from fibattn.config import DataConfig, ModelConfig, SourceConfig
from fibattn.model.lm import FibLM
from fibattn.ops import (backend_available, document_ids_from_cu_seqlens, document_ids_from_eos,
                         document_ids_from_position_ids)
from fibattn.ops.documents import offsets_unchecked
from run_helpers import micro_config

CPU = torch.device("cpu")
BACKENDS = [b for b in ("reference", "torch", "cpu") if backend_available(b, CPU) is None]
if backend_available("triton", CPU) is None:   # the interpreter is slow: tests/test_ops_documents_triton.py is the default
    BACKENDS.append(pytest.param("triton", marks=pytest.mark.slow))
DISTS = [0, 1, 2, 3, 5, 8, 13, 21]
SPLITS = [[1, 2, 7, 30, 3, 18], [61]]         # one row of many documents (lengths 1, 2, odd, > the largest distance)


def _ids(splits) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(s)), torch.tensor(s)) for s in splits])


def _qkv(T, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, T, 8, generator=g, dtype=dtype).requires_grad_() for h in (4, 2, 2)]


def _grads(fn, leaves, dout):
    for x in leaves:
        x.grad = None
    out = fn()
    out.backward(dout)
    return out.detach(), [None if x.grad is None else x.grad.clone() for x in leaves]


def _op(kind, backend, alpha):
    if kind == "integer":
        return lambda q, k, v, ids=None: fibattn.sparse_attention(q, k, v, DISTS, backend=backend, document_ids=ids)
    return lambda q, k, v, ids=None: fibattn.interpolated_sparse_attention(
        q, k, v, alpha=alpha, base="fib", window=3, backend=backend, document_ids=ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,a", [("integer", 1.0), ("interpolated", 1.37), ("interpolated", 2.0)])
def test_a_packed_row_equals_each_document_on_its_own(backend, kind, a):
    """Geometry (T = 61): documents of 1 and 2 rows are shorter than the window (3); in the 30-row one late
    rows reach every integer distance (up to 21) inside it while early rows' distances cross its start; at
    alpha 1.37 (rungs 4/5 .. 28/29, 46/47) its row 29 reads rung 28's second tap at the start itself and
    rung 46 is always cut, at 2.0 every second tap weighs 0; the second sample is one 61-row document."""
    T = sum(SPLITS[0])
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v = _qkv(T, dtype)
    alpha = torch.tensor(a, dtype=torch.float64, requires_grad=True)
    op = _op(kind, backend, alpha)
    dout = torch.randn(q.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    leaves = [q, k, v, alpha]
    out, grads = _grads(lambda: op(q, k, v, _ids(SPLITS)), leaves, dout)

    def separately():
        parts = []
        for b, split in enumerate(SPLITS):
            s, row = 0, []
            for n in split:
                row.append(op(*(x[b:b + 1, :, s:s + n] for x in (q, k, v))))
                s += n
            parts.append(torch.cat(row, dim=2))
        return torch.cat(parts)
    want_out, want = _grads(separately, leaves, dout)
    tol = {} if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, want_out, **tol)
    for got, exp in zip(grads[:3], want[:3]):
        torch.testing.assert_close(got, exp, **tol)
    if kind == "interpolated":
        torch.testing.assert_close(grads[3], want[3], **tol)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if isinstance(b, str)])
def test_one_document_per_row_is_the_plain_op_and_bf16_holds(backend):
    q, k, v = (x.detach().to(torch.bfloat16) for x in _qkv(40))
    plain = fibattn.sparse_attention(q, k, v, DISTS, backend=backend)
    one = fibattn.sparse_attention(q, k, v, DISTS, backend=backend, document_ids=torch.zeros(2, 40, dtype=torch.long))
    torch.testing.assert_close(one, plain, atol=0, rtol=0)
    ids = _ids([[13, 27], [40]])
    ref = fibattn.sparse_attention(q, k, v, DISTS, backend="reference", document_ids=ids)
    torch.testing.assert_close(fibattn.sparse_attention(q, k, v, DISTS, backend=backend, document_ids=ids), ref,
                               atol=2e-2, rtol=2e-2)


def test_flex_honours_documents_forward():
    if backend_available("flex", CPU) is not None:
        pytest.skip("flex_attention unavailable")
    q, k, v = (x.detach().float() for x in _qkv(61))
    ids = _ids(SPLITS)
    want = fibattn.sparse_attention(q, k, v, DISTS, backend="reference", document_ids=ids)
    torch.testing.assert_close(fibattn.sparse_attention(q, k, v, DISTS, backend="flex", document_ids=ids), want,
                               atol=1e-5, rtol=1e-5)


def test_document_ids_are_checked():
    q, k, v = (x.detach() for x in _qkv(10))
    with pytest.raises(ValueError, match="more than one run"):
        fibattn.sparse_attention(q, k, v, DISTS, document_ids=torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2, 2, 2]] * 2))
    with pytest.raises(ValueError, match="shape"):
        fibattn.sparse_attention(q, k, v, DISTS, document_ids=torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        fibattn.sparse_attention(q, k, v, DISTS, document_ids=torch.zeros(2, 10))


def test_converters_from_other_conventions():
    assert document_ids_from_cu_seqlens(torch.tensor([0, 2, 5, 6], dtype=torch.int32)).tolist() == \
        [[0, 0, 1, 1, 1, 2]]
    assert document_ids_from_cu_seqlens([0, 2, 3], total=5).tolist() == [[0, 0, 1, 2, 2]]
    with pytest.raises(ValueError, match="non-decreasing"):
        document_ids_from_cu_seqlens([0, 3, 2])
    assert document_ids_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])).tolist() == \
        [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert document_ids_from_eos(torch.tensor([[5, 9, 7, 9, 9, 1]]), 9).tolist() == [[0, 0, 1, 1, 2, 3]]
    assert offsets_unchecked(torch.tensor([[0, 0, 1, 1, 1, 2]])).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_compiled_ops_with_documents_match_eager():
    torch._dynamo.reset()
    q, k, v = _qkv(61, torch.float32)
    alpha = torch.tensor(1.37, requires_grad=True)
    ids = _ids(SPLITS)

    def f(q, k, v, alpha, ids):
        return (fibattn.sparse_attention(q, k, v, DISTS, backend="cpu", document_ids=ids)
                + fibattn.interpolated_sparse_attention(q, k, v, alpha=alpha, base="fib", window=3, backend="cpu",
                                                        document_ids=ids))
    leaves = [q, k, v, alpha]
    dout = torch.randn(q.shape)
    want, want_g = _grads(lambda: f(q, k, v, alpha, ids), leaves, dout)
    got, got_g = _grads(lambda: torch.compile(f, fullgraph=True)(q, k, v, alpha, ids), leaves, dout)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("attention,schedule", [("sparse", "linear"), ("sparse", "learned"), ("dense", "linear")])
def test_model_logits_per_document_equal_separate_runs(attention, schedule):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, window=4,
                      schedule=schedule, attention=attention, backend="cpu")
    torch.manual_seed(0)
    model = FibLM(cfg).double()
    lens = [5, 1, 20, 38]
    ids = torch.randint(0, 64, (1, 64))
    full = model(ids, document_ids=_ids([lens]))
    s = 0
    for n in lens:             # RoPE positions need not restart: scores depend on i - j only
        torch.testing.assert_close(full[:, s:s + n], model(ids[:, s:s + n]))
        s += n


# ------------------------------------------------------------------ training and evaluation
@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Many short documents, so that every training window holds several."""
    from fibattn.data import prepare
    root = tmp_path_factory.mktemp("short-docs")
    g = torch.Generator().manual_seed(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    with open(root / "docs.jsonl", "w") as f:
        for i in range(600):
            n = int(torch.randint(1, 8, (1,), generator=g))
            text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g))
            f.write(json.dumps({"text": f"{i}: {text}."}) + "\n")
    dcfg = DataConfig(out_dir=str(root / "data"), sources=[SourceConfig(name="short", kind="files",
                                                                        path=str(root / "docs.jsonl"))],
                      val_fraction=0.1)
    prepare(dcfg, progress=False)
    return root / "data"


def test_training_with_document_masking_never_attends_across_an_eos(tmp_path, short_docs, monkeypatch):
    from fibattn.data import data_config
    from fibattn.model import attention as A
    from fibattn.trainer.trainer import train
    seen = []
    real = A.sparse_attention

    def spy(q, k, v, dists, **kw):
        seen.append(kw.get("document_ids"))
        return real(q, k, v, dists, **kw)
    monkeypatch.setattr(A, "sparse_attention", spy)
    losses = {}
    for masking in (False, True):
        seen.clear()
        cfg = micro_config(tmp_path / f"run-{masking}", short_docs, steps=3, batch_tokens=128, micro_batch=2,
                           lr=3e-3, warmup_steps=1, log_every=1, ckpt_every=100, eval_tokens=128, threads=1,
                           document_masking=masking)
        cfg.model.backend = "cpu"
        cfg.data = data_config(short_docs)[0]
        res = train(cfg)
        losses[masking] = [loss for _, loss in res.losses]
        if not masking:
            assert all(ids is None for ids in seen)
            continue
        assert seen and all(ids is not None for ids in seen)
        recorded = json.loads((tmp_path / "run-True" / "config.json").read_text())["train"]
        assert recorded["document_masking"] is True
    assert any(ids.max() > 0 for ids in seen)                  # windows held several documents
    for ids in seen:                                           # a new document right after each <eos>
        assert ((ids[:, 1:] != ids[:, :-1]).sum() > 0)
    assert losses[True] != losses[False]
    from fibattn.cli import main as cli_main             # evaluated both ways: recorded side by side
    run = str(tmp_path / "run-True")
    for flag in ("--document-masking", "--no-document-masking"):
        assert cli_main(["eval", run, "--lengths", "32,64", "--tokens", "256", flag, "--no-plot", "--db", "off"]) == 0
    modes = {(r["mode"], r["document_masking"]) for r in json.loads((tmp_path / "run-True" / "eval.json")
                                                                   .read_text())["results"]}
    assert modes == {("study+docs", True), ("study", False)}


def test_training_batches_split_at_eos(short_docs):
    from fibattn.data import TokenData
    from fibattn.trainer.setup import document_kwargs
    data = TokenData(short_docs)
    x = torch.tensor([[1, data.eos_id, 2, 3, data.eos_id, data.eos_id, 4]])
    assert document_kwargs(True, data)(x)["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_kwargs(False, data)(x) == {}


def test_eval_with_document_masking_is_recorded_under_its_own_mode(tmp_path, short_docs):
    from fibattn.data import TokenData
    from fibattn.eval.perplexity import evaluate
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32, window=4,
                      backend="cpu")
    torch.manual_seed(0)
    model = FibLM(cfg)
    data = TokenData(short_docs)
    arrays = {"short": data.val_tokens("short")}
    plain = evaluate(model, arrays, [32, 64], tokens=512)
    masked = evaluate(model, arrays, [32, 64], tokens=512, document_eos=data.eos_id)
    assert masked.settings["mode"] == plain.settings["mode"] + "+docs"
    assert all(r.document_masking and r.mode.endswith("+docs") for r in masked.records)
    assert all(not r.document_masking for r in plain.records)
    # with every document scored on its own, the context length no longer matters much: both lengths agree
    # closely, and differ from the unmasked numbers
    assert masked.records[0].nll != plain.records[0].nll
