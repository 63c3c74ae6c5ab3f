"""Context parallelism without processes (method.md §9): the halo plan holds every row any tap reads, and
ranks run one after another in one process (their exchanges through mailboxes) give the one-process loss
and gradients.

Geometry. The model here attends at T = 64 with window 3 and fib base k = 8; learned alpha 1.37 reads the
taps 0..3 (the window) and the rungs' two taps 4/5, 6/7, 10/11, 17/18, 28/29 and 46/47. Splitting into
P = 4 chunks of 16 or P = 8 chunks of 8 makes each part of the plan necessary: a chunk is longer than the
window (3) and shorter than the largest rung's reach (47), so the last ranks take rows from several
earlier ranks, and some rows are read by a rung's second tap only (rank 3 of 4, starting at 48: row 1 only
through tap 47, row 19 only through tap 29). With P = 2 (chunks of 32) every row before the chunk is read
by some first tap, so a halo that forgot the second taps would still pass there.
"""
from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibattn.config import ModelConfig
from fibattn.model.attention import FibAttention
from fibattn.model.lm import FibLM
from fibattn.parallel import ContextShard, sharded
from fibattn.parallel import context as cp
from fibattn.parallel.halo import halo_plan, needed
from fibattn.schedules import interpolation_plan

T = 64


def _rows(intervals) -> set[int]:
    return {i for lo, hi in intervals for i in range(lo, hi)}


def _read_rows(layer, T: int, start: int, chunk: int) -> set[int]:
    """Rows of k and v that the queries ``start .. start + chunk - 1`` read, found from the gradient of the
    layer's own attention (the reference op), independently of the halo code."""
    g = torch.Generator().manual_seed(T * 131 + start)
    q, k, v = (torch.randn(1, 1, T, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = layer.attend(q, k, v)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out[:, :, start:start + chunk] * w[:, :, start:start + chunk]).sum().backward()
    touched = (k.grad.abs().sum(-1) + v.grad.abs().sum(-1))[0, 0]
    return {int(i) for i in torch.nonzero(touched).flatten()}


def _layer(window, alpha, base, learned, reach, reach_len, attention="sparse"):
    return FibAttention(8, 1, 1, attention=attention, window=window, base=base, alpha=alpha, learned=learned,
                        a_min=0.5, a_max=2.5, reach=reach, reach_len=reach_len, backend="reference").double()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_row_any_tap_reads_is_in_the_halo_and_nothing_else(data):
    """Property: for every rank, the rows before its chunk that its queries read (both taps of each
    interpolated rung, the window, integer rungs) are exactly the plan's received rows; the plan never asks
    for a row no tap reaches (so not the whole prefix)."""
    P = data.draw(st.sampled_from([2, 3, 4, 6, 8]), "ranks")
    chunk = data.draw(st.integers(2, 14), "chunk")
    T = P * chunk
    learned = data.draw(st.booleans(), "learned")
    window = data.draw(st.integers(0, 5), "window")
    alpha = data.draw(st.floats(0.6, 2.4), "alpha")
    base = data.draw(st.sampled_from(["fib", "pow2"]), "base")
    base = f"fib:{data.draw(st.integers(3, 10), 'k')}" if base == "fib" else "pow2"
    reach = data.draw(st.sampled_from(["study", "train"]), "reach")
    reach_len = data.draw(st.integers(4, T), "reach_len")
    layer = _layer(window, alpha, base, learned, reach, reach_len)
    dists = cp.layer_dists(layer, T)
    if learned:        # the taps by their definition: the window, then each rung's floor and floor + 1
        plan = interpolation_plan(window, layer.current_alpha(), layer.base, T, reach=layer._reach_arg())
        taps = set(plan.window) | {lo for lo, _ in plan.rungs} | {lo + 1 for lo, _ in plan.rungs}
    else:
        taps = set(layer.distances(T))
    for r in range(P):
        start = r * chunk
        plan = halo_plan(dists, r, P, chunk)
        halo = set().union(*(_rows(ivs) for _, ivs in plan.recv)) if plan.recv else set()
        read = {i for i in _read_rows(layer, T, start, chunk) if i < start}
        assert read <= halo, f"rank {r}: rows {sorted(read - halo)} are read but not received"
        reachable = {i - t for i in range(start, start + chunk) for t in taps if 0 <= i - t < start}
        assert halo == reachable, f"rank {r}: received {sorted(halo ^ reachable)} differ from the taps' rows"
        assert halo == _rows(needed(dists, r, chunk))
        assert plan.before == (start - min(halo) if halo else 0)     # the buffer starts at the first row read


def test_the_halo_of_the_learned_layer_needs_the_second_taps_here():
    """The geometry the one-process comparison below relies on (see the module docstring)."""
    layer = _layer(3, 1.37, "fib:8", True, "study", None)
    dists = cp.layer_dists(layer, T)
    plan = interpolation_plan(3, 1.37, "fib:8", T)
    first_taps = [*plan.window, *(lo for lo, _ in plan.rungs)]
    assert max(dists) == 47 and 3 < 16 < 47 and 3 < 8 < 47
    for P in (4, 8):
        c = T // P
        last = _rows(needed(dists, P - 1, c))
        only_firsts = _rows(needed(first_taps, P - 1, c))
        assert last - only_firsts, f"P={P}: no row of the last rank's halo is read by a second tap alone"
        assert len(halo_plan(dists, P - 1, P, c).recv) > 1        # several source ranks
    # two ranks: every earlier row is read by a first tap as well, which is why P=2 alone proves little
    assert _rows(needed(dists, 1, 32)) == _rows(needed(first_taps, 1, 32))


# ------------------------------------------------------------------ the ranks, one after another, in one process
class Mailboxes:
    """Stands in for ``context._exchange``: a rank's sends wait in a queue per (sender, receiver) until the
    receiver asks. Ranks run their forwards in rank order and their backwards in reverse rank order, so
    every message is posted before it is read (a halo flows to later ranks, its gradient back)."""

    def __init__(self):
        self.queues = defaultdict(deque)

    def __call__(self, shard, outgoing, incoming):
        for peer, t in outgoing.items():
            self.queues[(shard.rank, peer)].append(t.detach().clone())
        for peer, buf in incoming.items():
            queue = self.queues[(peer, shard.rank)]
            assert queue, f"rank {shard.rank} waits for rank {peer}, which sent nothing (a real run would hang)"
            got = queue.popleft()
            assert got.shape == buf.shape, f"rank {peer} sent {tuple(got.shape)}, rank {shard.rank} expects " \
                                           f"{tuple(buf.shape)}"
            buf.copy_(got)
        return incoming

    def empty(self) -> bool:
        return not any(self.queues.values())


CASES = {
    "learned": dict(schedule="learned", alpha=1.37),
    "linear": dict(schedule="linear", a_max=1.5),
    "pow2": dict(base="pow2", schedule="fixed", alpha=1.0),
    "dense": dict(attention="dense"),
}


def _model(settings, backend) -> FibLM:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=T, window=3,
                      base_k=8, backend=backend, **settings)
    torch.manual_seed(0)
    return FibLM(cfg).double()


def one_process_by_ranks(model, x, y, P, ids, monkeypatch):
    """The mean of the ranks' losses and of their gradients, each rank's forward on its chunk alone."""
    box = Mailboxes()
    monkeypatch.setattr(cp, "_exchange", box)
    shards = [ContextShard(None, tuple(range(P)), r, T, document_ids=ids) for r in range(P)]
    losses = []
    for shard in shards:                                  # forwards: halos flow to later ranks
        with sharded(model, shard):
            losses.append(model(shard.local(x), shard.local(y), offset=shard.start)[1])
    for loss in reversed(losses):                         # backwards: the halos' gradients flow back
        loss.backward()
    assert box.empty()
    return torch.stack(losses).mean().detach(), {n: p.grad / P for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("P,documents", [(4, False), (8, False), (4, True)])
def test_ranks_in_one_process_give_the_one_process_loss_and_gradients(monkeypatch, P, documents, backend):
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, T), generator=g) for _ in range(2))
    # documents: boundaries inside chunks and at a chunk's first row (16, 48), a document across three chunks
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 11, 32, 16]))[None].expand(2, T) \
        if documents else None
    for name, settings in CASES.items():
        model = _model(settings, backend)
        _, want_loss = model(x, y, document_ids=ids)
        want_loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        got_loss, got = one_process_by_ranks(model, x, y, P, ids, monkeypatch)
        torch.testing.assert_close(got_loss, want_loss.detach(), msg=lambda m: f"{name}: {m}")
        for n in want:
            torch.testing.assert_close(got[n], want[n], msg=lambda m: f"{name} {n}: {m}")


class RecordingShard(ContextShard):
    """Rank 0's shard; remembers the whole tensors it was asked to cut (the window's inputs and targets)."""

    def local(self, x):
        self.__dict__.setdefault("seen", []).append(x)
        return super().local(x)


class SequentialGroup:
    """A context group as evaluation sees it from rank 0; ``gather`` runs ranks 1..P-1 on the same window,
    one after another in this process (their halos from the mailboxes rank 0 filled), and concatenates."""

    def __init__(self, P: int, model):
        self.ranks, self.rank, self.model, self.windows = tuple(range(P)), 0, model, 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def shard(self, seq_len, document_ids=None):
        self.current = RecordingShard(None, self.ranks, 0, seq_len, document_ids)
        return self.current

    def gather(self, part):
        from fibattn.eval.perplexity import token_nll
        first = self.current
        x, y = first.seen[:2]
        self.windows += 1
        parts = [part]
        for r in self.ranks[1:]:
            shard = ContextShard(None, self.ranks, r, first.seq_len, first.document_ids)
            with sharded(self.model, shard):
                parts.append(token_nll(self.model, shard.local(x), shard.local(y), offset=shard.start))
        return torch.cat(parts, dim=1)


@pytest.mark.parametrize("reach, eos", [("study", None), ("train", None), ("study", 7)])
def test_evaluation_with_ranks_in_one_process_gives_the_one_process_records(monkeypatch, reach, eos):
    """Evaluation's context-parallel path (each rank scores its chunk of every window, the group gathers the
    values) against one process, for learned alpha at 64 (chunks of 16, P = 4) and at 128, past the training
    length (chunks of 32; with reach train the distances stop at 63), documents (eos 7) included. The
    torchrun CLI run of the same is tests/test_context_parallel.py's slow eval test."""
    import numpy as np
    from fibattn.eval.perplexity import evaluate
    box = Mailboxes()
    monkeypatch.setattr(cp, "_exchange", box)
    model = _model(CASES["learned"], "cpu").float()
    toks = {"val": np.random.default_rng(0).integers(0, 64, 1025)}
    kw = dict(tokens=256, reach=reach, document_eos=eos)
    one = evaluate(model, toks, [64, 128], **kw)
    group = SequentialGroup(4, model)
    got = evaluate(model, toks, [64, 128], context=group, **kw)
    assert box.empty() and group.windows >= 2
    assert [(r.length, r.tokens, r.mode) for r in got.records] == [(r.length, r.tokens, r.mode) for r in one.records]
    for a, b in zip(one.records, got.records):
        assert b.nll == pytest.approx(a.nll, rel=1e-5)
        assert [x["loss"] for x in b.buckets] == pytest.approx([x["loss"] for x in a.buckets], rel=1e-4)
