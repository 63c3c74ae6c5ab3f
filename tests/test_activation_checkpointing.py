"""Activation checkpointing (``train.activation_checkpointing``): ``full`` recomputes each block in the
backward and gives the same losses and gradients as ``none``, bit for bit on CPU fp32 (static and learned
alpha, packed documents), through the trainer and under ``torch.compile``; DDP is in test_train_ddp.py."""
import pytest
import torch
from safetensors.torch import load_file

from fibattn import devices
from fibattn.config import ConfigError, ModelConfig
from fibattn.model import lm
from fibattn.model.lm import FibLM
from fibattn.trainer.trainer import train
from fibattn.validation import check_training_fits
from run_helpers import micro_config

DOCS = torch.tensor([[0] * 10 + [1] * 22, [0] * 3 + [1] * 20 + [2] * 9])     # packed documents, (2, 32)


def _model(schedule: str) -> FibLM:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, window=4,
                      schedule=schedule)
    torch.manual_seed(0)
    return FibLM(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 32), generator=g) for _ in range(2)]


def _loss_and_grads(fn, model, docs=None):
    idx, tgt = _batch()
    model.zero_grad(set_to_none=True)
    _, loss = fn(idx, tgt, document_ids=docs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _block_calls(model) -> list:
    """The ``document_ids`` argument of every block's attention call, in order (hooks stay for the model's life)."""
    seen = []
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda mod, args: seen.append(args[2]))
    return seen


@pytest.mark.parametrize("docs", [None, DOCS], ids=["one-document", "packed"])
@pytest.mark.parametrize("schedule", ["linear", "learned"])
def test_full_gives_bit_identical_loss_and_gradients(schedule, docs):
    model = _model(schedule)
    calls = _block_calls(model)
    want_loss, want = _loss_and_grads(model, model.set_activation_checkpointing("none"), docs)
    assert len(calls) == 2
    got_loss, got = _loss_and_grads(model, model.set_activation_checkpointing("full"), docs)
    assert len(calls) == 2 + 4                                  # each block runs again in the backward
    assert all(d is docs for d in calls)                        # the recomputation sees the documents too
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if schedule == "learned":                                   # dalpha flows through the recomputed op
        alphas = [k for k in got if "alphas" in k]
        assert len(alphas) == 2 and all(got[k].abs().item() > 0 for k in alphas)


def test_inference_never_recomputes():
    model = _model("linear")
    idx, _ = _batch()
    want = model(idx)
    calls = _block_calls(model.set_activation_checkpointing("full"))
    with torch.no_grad():
        got = model(idx)
    assert len(calls) == 2 and torch.equal(got, want)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="activation checkpointing must be one of none, full, got 'some'"):
        _model("linear").set_activation_checkpointing("some")


def test_training_fits_check_counts_the_smaller_activations(monkeypatch):
    """A micro-batch refused with ``none`` fits with ``full``: the lower bound keeps one activation per layer
    plus one recomputed block's, not every block's."""
    m = ModelConfig(vocab_size=256, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, seq_len=16384, window=8)

    def need(mode):                            # the estimate the refusal names, in GB
        with pytest.raises(ConfigError, match="needs at least") as err:
            check_training_fits(m, 4, False, "cpu", checkpointing=mode)
        return float(str(err.value).split("needs at least ")[1].split(" GB")[0])

    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 1)
    none, full = need("none"), need("full")
    assert full < none / 2
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: int((none + full) / 2 * 1e9))
    check_training_fits(m, 4, False, "cpu", checkpointing="full")
    with pytest.raises(ConfigError, match="train.micro_batch"):
        check_training_fits(m, 4, False, "cpu")


def test_trainer_steps_are_identical_with_full(tmp_path, tiny_data, monkeypatch):
    """A few optimiser steps through the real trainer: the same losses and final weights, bit for bit."""
    recomputed = []

    def counting(fn, *args, **kwargs):
        recomputed.append(kwargs.get("use_reentrant"))
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(lm, "checkpoint", counting)
    runs = {}
    for mode in ("none", "full"):
        cfg = micro_config(tmp_path / mode, tiny_data, n_layers=2, steps=3, batch_tokens=128, micro_batch=2, lr=3e-3,
                           warmup_steps=1, log_every=1, ckpt_every=100, eval_tokens=64, threads=1, results_db="off",
                           activation_checkpointing=mode)
        runs[mode] = train(cfg)
    # 3 steps x 2 micro-batches x 2 layers x 2 halves, non-reentrant; the end-of-run evaluation adds none (no grad)
    assert recomputed == [False] * 24
    assert [v for _, v in runs["full"].losses] == [v for _, v in runs["none"].losses]
    a, b = (load_file(str(r.checkpoint / "model.safetensors")) for r in (runs["none"], runs["full"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow          # the default suite keeps the eager checks and tests/test_compile.py's fullgraph ones
def test_compiled_fullgraph_with_full_matches_eager():
    """Under ``torch.compile(fullgraph=True)`` (inductor; learned alpha, the interpolated op) each checkpointed
    block traces as dynamo's checkpoint operator, and losses and gradients match eager ``none`` to compiler
    tolerance."""
    from torch._dynamo.testing import EagerAndRecordGraphs
    torch._dynamo.reset()
    model = _model("learned")
    want_loss, want = _loss_and_grads(model, model)
    model.set_activation_checkpointing("full")
    got_loss, got = _loss_and_grads(torch.compile(model, fullgraph=True), model)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()
    rec = EagerAndRecordGraphs()
    torch.compile(model, backend=rec, fullgraph=True)(*_batch())
    code = "\n".join(g.code for g in rec.graphs)
    assert code.count("higher_order.tag_activation_checkpoint(") == 4, code       # 2 blocks x 2 halves
