"""Context parallelism with activation checkpointing (issue 58, kind 11): the backward recomputes each
checkpointed block after ``parallel.sharded`` has restored the layers, so the recomputation must attend
as the forward did (its halo exchange included), or torch.utils.checkpoint sees other tensors than the
forward saved. Both settings of ``train.activation_checkpointing`` give the same losses and gradients.

The fast test runs the ranks as threads of one process, their halo exchanges through blocking queues (a
recomputation's exchange happens in the middle of the backward, on every rank in the same order, as with
gloo); the torchrun test trains for real (``slow``)."""
from __future__ import annotations

import copy
import queue
import threading
from collections import defaultdict

import pytest
import torch

from fibattn.config import ModelConfig
from fibattn.model.lm import FibLM
from fibattn.parallel import ContextShard, sharded
from fibattn.parallel import context as cp

T = 32


class Wires:
    """``context._exchange`` between threads: a blocking queue per (sender, receiver)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queues = defaultdict(queue.Queue)

    def _q(self, a, b) -> queue.Queue:
        with self.lock:
            return self.queues[(a, b)]

    def __call__(self, shard, outgoing, incoming):
        for peer, t in outgoing.items():
            self._q(shard.rank, peer).put(t.detach().clone())
        for peer, buf in incoming.items():
            buf.copy_(self._q(peer, shard.rank).get(timeout=60))
        return incoming


def _ranks(model, x, y, P, ids, checkpointing, monkeypatch):
    """Each rank a thread with its own copy of ``model``: the mean loss and the mean of the ranks' gradients,
    the backward run outside ``sharded`` (as the trainer does)."""
    monkeypatch.setattr(cp, "_exchange", Wires())
    copies = [copy.deepcopy(model).set_activation_checkpointing(checkpointing) for _ in range(P)]
    losses, errors = [None] * P, []

    def rank(r):
        try:
            shard = ContextShard(None, tuple(range(P)), r, T, document_ids=ids)
            with sharded(copies[r], shard):
                loss = copies[r](shard.local(x), shard.local(y), offset=shard.start)[1]
            loss.backward()
            losses[r] = loss.detach()
        except BaseException as exc:            # noqa: BLE001 - reported by the test
            errors.append(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    grads = {n: sum(dict(m.named_parameters())[n].grad for m in copies) / P for n, _ in model.named_parameters()}
    return torch.stack(losses).mean(), grads


CASES = {"learned": dict(schedule="learned", alpha=1.37), "fixed": dict(schedule="fixed", alpha=1.0),
         "linear": dict(schedule="linear"), "dense": dict(attention="dense")}


@pytest.mark.parametrize("P,documents", [(2, False), (4, True)])
def test_checkpointing_under_context_parallelism_gives_the_same_losses_and_gradients(monkeypatch, one_thread, P,
                                                                                     documents):
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 64, (2, T), generator=g) for _ in range(2))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 13, 14]))[None].expand(2, T) if documents else None
    for name, settings in CASES.items():
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=T, window=2,
                          base_k=7, backend="torch", **settings)
        torch.manual_seed(0)
        model = FibLM(cfg).double()
        off_loss, off = _ranks(model, x, y, P, ids, "none", monkeypatch)
        on_loss, on = _ranks(model, x, y, P, ids, "full", monkeypatch)
        assert torch.equal(on_loss, off_loss), name
        for n in off:
            assert torch.equal(on[n], off[n]), f"{name} {n}"
        _, want = model(x, y, document_ids=ids)                 # and both are the one-process loss
        torch.testing.assert_close(on_loss, want.detach())


@pytest.mark.slow
def test_training_under_torchrun_with_context_parallelism_and_checkpointing_matches_without(tiny_data, tmp_path):
    """Two gloo processes, one context group: the same per-step losses and final weights with
    ``train.activation_checkpointing=full`` as with ``none``."""
    import json

    from safetensors.torch import load_file

    from fibattn import config as C
    from test_context_parallel import _torchrun
    from test_train_ddp import cfg_for
    runs = {}
    for mode in ("none", "full"):
        cfg = cfg_for(tmp_path / mode, tiny_data)
        cfg.train.context_parallel, cfg.train.activation_checkpointing = 2, mode
        C.save(cfg, tmp_path / f"{mode}.json")
        _torchrun(2, tmp_path / f"{mode}.json", tmp_path / mode)
        losses = [json.loads(line)["loss"] for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in line]
        ckpt = sorted((tmp_path / mode / "checkpoints").glob("step-*"))[-1]
        runs[mode] = losses, load_file(ckpt / "model.safetensors")
    assert runs["full"][0] == runs["none"][0] and runs["none"][0]
    for n, t in runs["none"][1].items():
        assert torch.equal(runs["full"][1][n], t), n
