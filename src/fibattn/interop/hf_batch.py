"""What a transformers batch's ``position_ids`` and attention mask say about its rows, for
:mod:`fibattn.interop.hf_llama`: packed documents (padding-free batches) and padding; and the compact mask
function that keeps transformers from building a T x T mask for a padded batch.

Every layer of a forward gets the same tensors, so each is read (and checked) once a forward: the result is
kept against the tensor it came from (a weakref and its version) until another comes.
"""
from __future__ import annotations

import weakref

import torch

from ..checks import UsageError
from ..ops import document_ids_from_cu_seqlens, document_ids_from_position_ids
from ..ops.documents import offsets_unchecked

_documents_of: list = [None, None, None, None]
_key_padding_of: list = [None, None, None, None]
_padded_rows_of: list = [None, None, None, None]


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


def padding_mask(*args, **kwargs):
    """transformers' mask function for fibattn (``AttentionMaskInterface``): for the plain causal mask, the 2-D
    padding of the keys handed over ``(B, kv_length)`` (None when nothing is padded) instead of a
    ``(B, 1, Tq, Tk)`` mask, so no T x T mask is built; the attention adds the causal part. Any other mask
    function (packed sequences, overlays) gets transformers' own boolean mask; over a whole unpadded batch without
    a cache (packed sequences), a :class:`DeferredMask` of it."""
    from transformers import masking_utils as mu
    mask = kwargs.get("attention_mask")
    if kwargs.get("mask_function", mu.causal_mask_function) is not mu.causal_mask_function or args:
        whole = (not args and mask is None and kwargs.get("use_vmap") is False and kwargs.get("q_offset") == 0
                 and kwargs.get("kv_offset") == 0 and kwargs.get("q_length") == kwargs.get("kv_length"))
        return DeferredMask(kwargs) if whole else mu.sdpa_mask(*args, **kwargs)
    if mask is None:
        return None
    n, offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)
    if mask.shape[-1] < offset + n:      # as transformers does: keys past the mask are not seen
        mask = torch.nn.functional.pad(mask, (0, offset + n - mask.shape[-1]))
    mask = mask[:, offset:offset + n].to(torch.bool)
    return None if bool(mask.all()) else mask


class DeferredMask:
    """transformers' boolean mask ``(B, 1, T, T)`` for another mask function than the plain causal one (packed
    sequences), not built until the attention needs it whole: the sparse op reads it at its own columns only.
    Every layer of the forward gets this one object, so each answer is worked out once."""

    dtype = torch.bool

    def __init__(self, kwargs: dict):
        self.kwargs, self._built, self._hidden = kwargs, None, (None, {})

    def dim(self) -> int:
        return 4

    def build(self) -> torch.Tensor:
        from transformers import masking_utils as mu
        if self._built is None:
            self._built = mu.sdpa_mask(**self.kwargs)
        return self._built

    def hides(self, ids, dists) -> bool:
        """Whether it hides a key at one of ``dists`` from a query whose document (``ids`` ``(B, T)``) holds it."""
        if self._hidden[0] is not ids:
            self._hidden = (ids, {})
        answers, key = self._hidden[1], frozenset(dists)
        if key not in answers:
            answers[key] = self._hides(ids, key)
        return answers[key]

    def _hides(self, ids, dists) -> bool:
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        off = offsets_unchecked(ids)                                       # position inside the document
        d = torch.tensor(sorted(dists), device=ids.device)
        q = pos[None, :, None].expand(B, T, len(d))
        inside = d <= off[..., None]
        batch, head = torch.arange(B, device=ids.device)[:, None, None], torch.zeros((), dtype=torch.long)
        seen = self.kwargs["mask_function"](batch, head.to(ids.device), q, (q - d).clamp(min=0))
        return bool((inside & ~seen.to(torch.bool)).any())


def key_padding(mask, tq: int, tk: int) -> torch.Tensor | None:
    """``(B, tk)``: which of the last ``tk`` keys are real, from a 2-D padding mask (:func:`padding_mask`) or a
    ``(B, 1, tq, >= tk)`` boolean mask that is exactly causal over them (what transformers builds); None for any
    other mask. The queries are the last ``tq`` keys' positions."""
    return _per_forward(_key_padding_of, mask, (tq, tk), lambda: mask[:, mask.shape[-1] - tk:] if mask.dim() == 2
                        else _from_4d(mask, tq, tk))


def _from_4d(mask, tq: int, tk: int):
    m = mask[:, 0, :, mask.shape[-1] - tk:]
    real = m[:, -1]                                   # the last query sees every real key
    return real if torch.equal(m, causal(tq, tk, m.device) & real[:, None, :]) else None


def causal(tq: int, tk: int, device) -> torch.Tensor:
    """``(tq, tk)`` bool: the queries (the last ``tq`` keys' positions) see the keys up to their own."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def padded_rows(real) -> tuple[torch.Tensor, list[int]] | None:
    """``(document_ids (B, T), each row's real length)`` when each row's real tokens are one run (left, right or
    both sides padded): padding before the run, the run and padding after it as three documents, so the run's
    tokens see each other only, as if unpadded (RoPE sees relative positions only). None otherwise."""
    return _per_forward(_padded_rows_of, real, None, lambda: _runs(real))


def _runs(real):
    T = real.shape[-1]
    pos = torch.arange(T, device=real.device)
    n = real.sum(-1)
    first = torch.where(real, pos, T).amin(-1)
    last = torch.where(real, pos, -1).amax(-1)
    if bool((n != (last - first + 1).clamp(min=0)).any()):
        return None                                   # a gap inside a row's real tokens
    ids = (pos >= first[:, None]).long() + (pos > last[:, None]).long()
    return ids, [max(int(x), 1) for x in n.tolist()]


def pads_apart(ids, real) -> bool:
    """No document of ``ids`` ``(B, T)`` holds both real tokens and padding (``real`` ``(B, T)``): the real
    documents see no padding."""
    return not bool(((real[:, 1:] != real[:, :-1]) & (ids[:, 1:] == ids[:, :-1])).any())
