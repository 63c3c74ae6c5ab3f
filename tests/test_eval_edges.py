"""Evaluation at its edges, against definitions written out independently of eval/perplexity.py:
lengths the bucket count does not divide, tail windows, budgets at their exact boundary, and the
record of what was scored (its sha256 and byte count) from the split itself."""
import hashlib

import numpy as np
import pytest
import torch
from torch import nn

from fibattn.data import ByteTokenizer
from fibattn.eval import perplexity as E


class PositionBigram(nn.Module):
    """Logits from the input token plus the position in the window: a target's NLL depends on
    exactly (previous token, target, window position), so expectations are computable by hand."""

    def __init__(self, vocab, max_len, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = nn.Parameter(torch.randn(vocab, vocab, generator=g))
        self.pos = nn.Parameter(torch.randn(max_len, vocab, generator=g))

    def forward(self, x):
        return self.tok[x] + self.pos[: x.shape[1]]

    def nll(self, prev, target, position):
        logits = (self.tok[prev] + self.pos[position]).detach().double()
        return float(torch.logsumexp(logits, 0) - logits[target])


def _position(t: int, n: int, length: int) -> int:
    """Window position of target t (1-based) of n: back-to-back windows, then the last n mod L targets
    at the end of one window that ends at target n (the docstring's rule)."""
    full = n // length * length
    return (t - 1) % length if t <= full else length - 1 - (n - t)


def _expected(model, toks, n, length, buckets):
    per_pos = [[] for _ in range(length)]
    for t in range(1, n + 1):
        p = _position(t, n, length)
        per_pos[p].append(model.nll(int(toks[t - 1]), int(toks[t]), p))
    nb = min(buckets, length)
    return per_pos, nb


@pytest.mark.parametrize("lengths, buckets", [([7, 10], 4), ([9, 12], 5), ([9, 16], 3), ([5, 12], 8)])
def test_buckets_are_means_over_their_positions_at_lengths_the_count_does_not_divide(lengths, buckets):
    toks = np.random.default_rng(3).integers(0, 6, size=200).astype(np.uint16)
    model = PositionBigram(6, max(lengths))
    # the shorter length does not divide the budget (a multiple of the longer): a tail window there
    rep = E.evaluate(model, {"a": toks}, lengths, tokens=len(toks) - 1, buckets=buckets)
    n = rep.datasets["a"]["tokens"]
    assert n == (len(toks) - 1) // max(lengths) * max(lengths)
    assert n % min(lengths)
    for length in lengths:
        rec = rep.record("a", length)
        per_pos, nb = _expected(model, toks, n, length, buckets)
        assert rec.nll == pytest.approx(np.mean([v for vs in per_pos for v in vs]), rel=1e-6)
        b = rec.buckets
        assert len(b) == nb and b[0]["start"] == 0 and b[-1]["end"] == length
        assert all(x["end"] == y["start"] for x, y in zip(b, b[1:]))
        sizes = [x["end"] - x["start"] for x in b]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1        # equal spans, as equal as whole positions go
        for x in b:
            vals = [v for p in range(x["start"], x["end"]) for v in per_pos[p]]
            assert x["loss"] == pytest.approx(np.mean(vals), rel=1e-6)


def test_more_buckets_than_positions_gives_one_per_position():
    b = E.position_buckets(np.arange(5.0) * 2, 2, 32)
    assert [(x["start"], x["end"], x["loss"]) for x in b] == [(p, p + 1, float(p)) for p in range(5)]


@pytest.mark.parametrize("length", [8, 16])
def test_budget_at_its_exact_boundary(length):
    toks = np.random.default_rng(1).integers(0, 6, size=4 * length + 1).astype(np.uint16)
    model = PositionBigram(6, length)
    # exactly one window's worth: L + 1 tokens and tokens = L score L targets
    rep = E.evaluate(model, {"a": toks[: length + 1]}, [length], tokens=length)
    assert rep.datasets["a"]["tokens"] == length and rep.record("a", length).windows == 1
    # one token short of that, either way, is refused (naming the lengths)
    with pytest.raises(ValueError, match="lengths"):
        E.evaluate(model, {"a": toks[:length]}, [length], tokens=length)
    with pytest.raises(ValueError, match="lengths"):
        E.evaluate(model, {"a": toks[: length + 1]}, [length], tokens=length - 1)
    # a split of exactly k·L tokens holds k·L - 1 targets: k - 1 windows, never k
    assert E.scored_budget(4 * length, 10 ** 6, [length]) == 3 * length
    assert E.scored_budget(4 * length + 1, 10 ** 6, [length]) == 4 * length
    assert E.scored_budget(4 * length + 1, 4 * length, [length]) == 4 * length
    assert E.scored_budget(4 * length + 1, 4 * length - 1, [length]) == 3 * length
    rep = E.evaluate(model, {"a": toks[: 4 * length]}, [length], tokens=10 ** 6)
    assert rep.datasets["a"]["tokens"] == 3 * length


def test_the_scored_record_is_computed_from_the_split():
    """sha256 (of the scored targets as int64), byte count and span follow from the split itself, on a
    split whose period (5) would hide a shift by one."""
    tok = ByteTokenizer()
    toks = np.array([255, 72, 105, 33, 10] * 40, dtype=np.uint8)          # eos first: a shift changes the count
    toks[0] = 65
    for arr in (toks, toks.astype(np.uint16), toks.astype(np.int64)):
        rep = E.evaluate(PositionBigram(256, 8), {"b": arr}, [8], tokens=160, tokenizer=tok)
        d, r = rep.datasets["b"], rep.record("b", 8)
        targets = np.asarray(toks[1:161], dtype=np.int64)
        assert d["sha256"] == r.scored_sha256 == hashlib.sha256(targets.astype("<i8").tobytes()).hexdigest()
        assert (d["first"], d["last"]) == (1, 160)
        assert r.bytes == d["bytes"] == int(np.sum(targets != 255)) == 128
