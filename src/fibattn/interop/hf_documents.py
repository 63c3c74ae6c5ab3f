"""The transformers drop-in's attention over the documents of a batch (:mod:`fibattn.interop.hf_llama`): packed
documents and padded rows, each through the set of its own length, as its own unpadded call would attend;
and a cached step's queries over the keys at their distances only.

Where a document's set is the set at T cut to its length (fib and custom bases, pow2 with alpha >= 1), one call
of the sparse op serves every document; other lengths (pow2 with alpha < 1 gains short distances as the
length grows) take a call per distinct set. A mask that hides keys inside a document takes the dense path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import sparse_attention
from ..ops.documents import offsets_unchecked


def attend(query, key, value, allowed, scaling):
    """Dense attention through the boolean ``allowed`` ``(B, 1, Tq, Tk)``."""
    tq, tk = query.shape[2], key.shape[2]
    # a padding query may see no key at all: let it see itself so no NaN reaches the real tokens
    empty = ~allowed.any(-1, keepdim=True)
    diag = torch.zeros_like(allowed)
    diag[..., torch.arange(tq), torch.arange(tk - tq, tk)] = True
    allowed = allowed | (empty & diag)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])


def packed(spec, full, query, key, value, ids, mask, scaling):
    """Packed documents ``ids`` (``Tq == Tk``, ``full`` the set at T; ``spec`` the layer's ``LayerSpec``): each
    query attends inside its own document through the set of the document's real length -- what the document
    gives on its own. ``mask``: boolean ``(B, 1, T, >= T)``, or None."""
    T, dev = query.shape[2], query.device
    pos = torch.arange(T, device=dev)
    seen = inside = None
    if mask is not None:
        inside = _inside(ids, pos)
        seen = inside & mask[:, 0, :, -T:]
    if seen is None or torch.equal(seen, inside):       # transformers' own packed mask hides nothing in a document
        return _by_sets(spec, full, query, key, value, ids, scaling)
    # a document's real length: the keys its last token sees (a padding mask hides its pads)
    real = seen.sum(-1).gather(1, _spans(ids)[1])
    gap = pos[:, None] - pos[None, :]
    pattern = torch.zeros_like(seen)
    for n in real.unique().tolist():
        pattern |= (real == n)[..., None] & torch.isin(gap, torch.tensor(spec.distances(max(n, 1)), device=dev))
    return attend(query, key, value, (pattern & seen)[:, None], scaling)


def padded(spec, full, query, key, value, ids, lengths, per_row: bool, scaling):
    """Rows whose real tokens are one run each (``ids``: the pads before it, the run, the pads after it, as
    documents; ``lengths``: each row's run): the sparse op with each row's own set (``per_row``; else every row
    through ``full``); one call per distinct set."""
    sets = [_set_for(spec, full, n) if per_row else tuple(full) for n in lengths]
    return _per_set(sets, (query, key, value, ids), lambda q, k, v, i, dists: sparse_attention(
        q, k, v, list(dists), scale=scaling, backend=spec.backend, document_ids=i))


def gathered(spec, full, query, key, value, real, per_row: bool, scaling):
    """A cached step (``tq < tk``): the queries at the last ``tq`` of the ``tk`` key positions in hand, each
    through the keys at its set's distances, gathered: O(Tq·|D|), where a mask over every key costs O(Tq·Tk).
    ``real`` ``(B, tk)``: the keys that are not padding, or None. ``per_row``: every key of the rows is in hand,
    so a row's length is its real keys and it takes that length's set; else every row takes ``full``."""
    if per_row and real is not None:       # a padded row's length is its real keys
        sets = [_set_for(spec, full, n) for n in real.sum(-1).clamp(min=1).tolist()]
    else:                                  # every row's length is the keys in hand: ``full`` (no set a row a step)
        sets = [tuple(full)] * key.shape[0]
    return _per_set(sets, (query, key, value, real), lambda q, k, v, r, dists: _gather(q, k, v, dists, r, scaling))


def _per_set(sets: list[tuple], tensors: tuple, run):
    """``run(*tensors, dists)`` once per distinct set of ``sets`` (one a row), on the rows of the tensors (None
    stays None) that take it, the outputs put back in row order; one call on every row when all take one set."""
    if len(set(sets)) == 1:
        return run(*tensors, sets[0])
    out = None
    for dists in dict.fromkeys(sets):
        b = torch.tensor([i for i, s in enumerate(sets) if s == dists], device=tensors[0].device)
        got = run(*(None if x is None else x[b] for x in tensors), dists)
        out = got.new_empty((len(sets),) + got.shape[1:]) if out is None else out
        out[b] = got
    return out


def _gather(query, key, value, dists, real, scaling):
    B, H, tq, Dh = query.shape
    Hk, tk = key.shape[1], key.shape[2]
    at = torch.arange(tk - tq, tk, device=query.device)[:, None] - torch.tensor(dists, device=query.device)
    valid = (at >= 0).expand(B, tq, len(dists))
    at = at.clamp(min=0)
    if real is not None:
        valid = valid & real[:, at]
    valid = valid | ~valid.any(-1, keepdim=True)     # a pad that sees nothing: finite, and nothing reads it
    k, v = key[:, :, at], value[:, :, at]                           # (B, Hk, tq, |D|, Dh)
    q = query.reshape(B, Hk, H // Hk, tq, Dh)
    s = torch.einsum("bkgqd,bkqcd->bkgqc", q, k)
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * (Dh ** -0.5 if scaling is None else scaling)
    p = s.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1).to(v.dtype)
    return torch.einsum("bkgqc,bkqcd->bkgqd", p, v).reshape(B, H, tq, Dh)


def _set_for(spec, full, n: int) -> tuple:
    """The set a document of length ``n`` attends through: ``full`` (the set at T) where the document's own set is
    that one cut to its length, so one call serves them all; else its own."""
    own = spec.distances(n)
    return tuple(full) if own == [d for d in full if d < n] else tuple(own)


def _by_sets(spec, full, query, key, value, ids, scaling):
    """Packed documents ``ids`` on the sparse op, each token through the set of its document's length: one call
    per distinct set over the whole batch, each token's output taken from its set's call."""
    first, last = _spans(ids)
    length = last - first + 1                                   # each token's document's length
    sets: dict[tuple, list[int]] = {}
    for n in length.unique().tolist():
        sets.setdefault(_set_for(spec, full, n), []).append(n)
    out = None
    for dists, ns in sets.items():
        got = sparse_attention(query, key, value, list(dists), scale=scaling, backend=spec.backend, document_ids=ids)
        mine = torch.isin(length, torch.tensor(ns, device=ids.device))[:, None, :, None]
        out = got if out is None else torch.where(mine, got, out)
    return out


def _spans(ids):
    """``(first, last)`` ``(B, T)``: the first and the last position of each token's document."""
    T, pos = ids.shape[1], torch.arange(ids.shape[1], device=ids.device)
    end = torch.ones_like(ids, dtype=torch.bool)
    end[:, :-1] = ids[:, 1:] != ids[:, :-1]
    return pos - offsets_unchecked(ids), torch.where(end, pos, T).flip(-1).cummin(-1).values.flip(-1)


def _inside(ids, pos):
    """``(B, T, T)``: key ``j`` is in query ``i``'s document and not after it."""
    return (ids[:, :, None] == ids[:, None, :]) & (pos[:, None] >= pos[None, :])
