"""The transformers drop-in's attention over the documents of a batch (:mod:`fibattn.interop.hf_llama`): packed
documents and padded rows, each through the set of its own length, as its own unpadded call would attend.

Where a document's set is the set at T cut to its length (fib and custom bases, pow2 with alpha >= 1), one call
of the sparse op serves every document; other lengths (pow2 with alpha < 1 gains short distances as the
length grows) take a call per distinct set. A mask that hides keys inside a document takes the dense path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import sparse_attention


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


def padded(spec, full, query, key, value, ids, lengths, scaling):
    """Rows whose real tokens are one run each (``ids``: the pads before it, the run, the pads after it, as
    documents; ``lengths``: each row's run): the sparse op with each row's own set; one call per distinct set."""
    groups: dict[tuple, list[int]] = {}
    for b, n in enumerate(lengths):
        groups.setdefault(_set_for(spec, full, n), []).append(b)
    if len(groups) == 1:
        (dists,) = groups
        return sparse_attention(query, key, value, list(dists), scale=scaling, backend=spec.backend, document_ids=ids)
    out = query.new_empty(query.shape)
    for dists, rows in groups.items():
        b = torch.tensor(rows, device=query.device)
        out[b] = sparse_attention(query[b], key[b], value[b], list(dists), scale=scaling, backend=spec.backend,
                                  document_ids=ids[b])
    return out


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
    start, end = torch.ones_like(ids, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = end[:, :-1] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(start, pos, 0).cummax(-1).values
    return first, torch.where(end, pos, T).flip(-1).cummin(-1).values.flip(-1)


def _inside(ids, pos):
    """``(B, T, T)``: key ``j`` is in query ``i``'s document and not after it."""
    return (ids[:, :, None] == ids[:, None, :]) & (pos[:, None] >= pos[None, :])
