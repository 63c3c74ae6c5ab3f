"""What a transformers batch's ``position_ids`` and attention mask say about its rows, for
:mod:`fibattn.interop.hf_llama`: packed documents (padding-free batches) and right padding.

Every layer of a forward gets the same tensors, so each is read (and checked) once a forward: the result is
kept against the tensor it came from (a weakref and its version) until another comes.
"""
from __future__ import annotations

import weakref

import torch

from ..checks import UsageError
from ..ops import document_ids_from_cu_seqlens, document_ids_from_position_ids

_documents_of: list = [None, None, None, None]
_right_padding_of: list = [None, None, None, None]


def _per_forward(cache: list, source: torch.Tensor, key, compute):
    """``compute()``, kept in ``cache`` (a weakref to ``source``, its version, ``key``, the value) until
    another tensor, a change to it or another ``key`` comes."""
    ref, version, k, value = cache
    if ref is not None and ref() is source and version == source._version and k == key:
        return value
    value = compute()
    cache[:] = [weakref.ref(source), source._version, key, value]
    return value


def packed_documents(query, kwargs) -> tuple[torch.Tensor, set[int]] | None:
    """``(document_ids (B, T), their lengths)`` of a packed batch (``Tq == Tk``, keys not from a cache), from
    ``cu_seq_lens_q`` when given, else from ``position_ids`` that restart; None when every row is one document."""
    cu, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    source = cu if cu is not None else pos
    if source is None:
        return None
    return _per_forward(_documents_of, source, (query.shape[0], query.shape[2]),
                        lambda: _documents(query, cu, pos, kwargs.get("cu_seq_lens_k")))


def _documents(query, cu, pos, cu_k):
    """:func:`packed_documents` computed (checked: cu_seq_lens for one row, equal for queries and keys)."""
    B, tq = query.shape[0], query.shape[2]
    if cu is not None:
        if B != 1 or (cu_k is not None and not torch.equal(cu_k.cpu(), cu.cpu())):
            raise UsageError(f"fibattn attention takes cu_seq_lens for one packed row with cu_seq_lens_q == "
                             f"cu_seq_lens_k (what DataCollatorWithFlattening makes), got batch size {B}")
        ids = document_ids_from_cu_seqlens(cu.to(query.device, torch.long), total=tq)
    else:
        ids = document_ids_from_position_ids(pos.to(query.device).expand(B, -1))
    if not ids[:, -1].any():
        return None
    return ids, {n for row in ids for n in torch.unique_consecutive(row, return_counts=True)[1].tolist()}


def right_padded_lengths(mask, t: int) -> set[int] | None:
    """The real lengths of a right-padded batch, or None for any other boolean ``mask`` ``(B, 1, t, >= t)``:
    each row's real keys a prefix and the mask exactly causal over them (what transformers builds). Its
    real tokens see no padding, so with one set for every length they are the sparse op's rows."""
    return _per_forward(_right_padding_of, mask, t, lambda: _right_padded(mask, t))


def _right_padded(mask, t: int) -> set[int] | None:
    m = mask[:, 0, :, mask.shape[-1] - t:].to(torch.bool)
    real = m[:, -1]                                   # the last query sees every real key
    if (real[:, 1:] & ~real[:, :-1]).any():
        return None
    causal = torch.ones(t, t, dtype=torch.bool, device=m.device).tril()
    if not torch.equal(m, causal & real[:, None, :]):
        return None
    return {max(int(n), 1) for n in real.sum(-1).tolist()}
